"""Run checkpoints under RUN/checkpoints: staged in a temporary dir, renamed when complete, `latest` updated last,
only the newest `keep` kept; finding the checkpoint to resume from, skipping damaged ones with a warning."""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .layout import HF_DIR, MODEL_DIR, TRAINER_STATE, CheckpointError, copy_hf_metadata, read_manifest, write_manifest

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointStore:
    def __init__(self, run_dir: str | Path, keep: int = 0) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep  # 0: keep every checkpoint

    def save(
        self,
        step: int,
        write_model: Callable[[str], None],
        trainer_state: dict[str, Any],
        hf_dir: str | Path,
        info: dict[str, Any],
        state_files: dict[str, Any] | None = None,
    ) -> Path:
        """`write_model(dir)` writes the Megatron checkpoint into an existing empty dir; `hf_dir` gives the config
        and tokenizer files kept beside it; `info` goes into the manifest; `state_files` (name -> JSON data) are
        more of the run's state, each a JSON file beside the trainer state. A failed write (a full disk, say) removes
        what it staged and raises CheckpointError naming the checkpoint that is still intact."""
        final = self.root / f"step_{step:06d}"
        staging = self.root / f".incomplete_step_{step:06d}"
        try:
            if staging.exists():
                shutil.rmtree(staging)
            (staging / MODEL_DIR).mkdir(parents=True)
            write_model(str(staging / MODEL_DIR))
            copy_hf_metadata(hf_dir, staging / HF_DIR)
            (staging / TRAINER_STATE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
            for name, data in (state_files or {}).items():
                (staging / name).write_text(json.dumps(data, ensure_ascii=False))
            write_manifest(staging, {"kind": "run", "step": step, **info})
        except Exception as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise self._write_failed(final.name, error) from error
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
        (self.root / "latest.tmp").write_text(final.name + "\n")
        (self.root / "latest.tmp").rename(self.root / "latest")
        self._prune(keep_also=final)
        return final

    def _write_failed(self, name: str, error: Exception) -> CheckpointError:
        previous, _ = self.newest_complete()
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            cause = f"the disk is full under {self.root} (free space, or point trainer.output_dir elsewhere)"
        else:  # errors raised in a Ray worker arrive wrapped: their last line is the original one
            cause = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        return CheckpointError(f"writing checkpoint {name} failed, {cause}; {kept}")

    def _step_dirs(self) -> list[Path]:
        """step_* dirs, newest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), path) for path in self.root.iterdir() if (m := _STEP_DIR.match(path.name))]
        return [path for _, path in sorted(found, reverse=True)]

    def _prune(self, keep_also: Path) -> None:
        for staging in self.root.glob(".incomplete_step_*"):
            shutil.rmtree(staging, ignore_errors=True)
        if self.keep:
            for path in self._step_dirs()[self.keep:]:
                if path != keep_also:
                    shutil.rmtree(path, ignore_errors=True)

    def newest_complete(self, check_contents: bool = False) -> tuple[Path | None, list[str]]:
        """The newest checkpoint that passes its manifest check (`check_contents`: its files' sha256 too, for one
        about to be loaded), and a warning for each newer one skipped (damaged, truncated, or still being written
        when the run stopped)."""
        skipped = []
        for path in self._step_dirs():
            try:
                read_manifest(path, check_contents)
            except CheckpointError as error:
                skipped.append(f"skipping checkpoint {path.name}: {error}")
                continue
            return path, skipped
        return None, skipped


def load_run_checkpoint(path: str | Path, check_contents: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, trainer state) of a complete run checkpoint (`check_contents`: its files' sha256 checked too);
    CheckpointError saying what is wrong otherwise."""
    path = Path(path)
    manifest = read_manifest(path, check_contents)
    if manifest.get("kind") != "run":
        raise CheckpointError(
            f"{path} holds model weights only (no optimizer or trainer state), so a run cannot resume from it; "
            f"convert it to HuggingFace (rlsearch convert mcore-to-hf) and start a run with model.path set to that"
        )
    return manifest, json.loads((path / TRAINER_STATE).read_text())
