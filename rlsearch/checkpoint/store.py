"""Run checkpoints under RUN/checkpoints: written to a temporary dir, renamed when complete, `latest` last."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "megatron"


class CheckpointStore:
    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir) / "checkpoints"

    def save(self, step: int, write_model: Callable[[str], None], trainer_state: dict[str, Any]) -> Path:
        """`write_model(dir)` writes the Megatron checkpoint into an existing empty dir."""
        final = self.root / f"step_{step:06d}"
        staging = self.root / f".incomplete_step_{step:06d}"
        if staging.exists():
            shutil.rmtree(staging)
        (staging / MODEL_DIR).mkdir(parents=True)
        write_model(str(staging / MODEL_DIR))
        (staging / TRAINER_STATE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        (self.root / "latest.tmp").write_text(final.name + "\n")
        (self.root / "latest.tmp").rename(self.root / "latest")
        return final
