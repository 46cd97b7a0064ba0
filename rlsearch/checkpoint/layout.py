"""What a checkpoint directory holds, and how a complete one is told from a partial or damaged one.

    step_000004/
      megatron/           Megatron distributed checkpoint (torch_dist): model [+ optimizer, scheduler, RNG]
      critic/             the same of the critic (algo.advantage=gae runs): its value model's checkpoint
      hf/                 the model's HF config, generation config and tokenizer (no weights): enough to
                          rebuild the architecture and to write a HuggingFace dir from the weights
      trainer_state.json  step, data-loader position, sampling seed, the run config (run checkpoints only)
      manifest.json       written last: format, parallel layout, contents, and every file with its size

A directory without a manifest, or whose files no longer match it (deleted, truncated), is not complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

MODEL_DIR = "megatron"
CRITIC_DIR = "critic"
HF_DIR = "hf"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
FORMAT = "rlsearch-checkpoint/1"

# the files of an HF model dir besides its weights
HF_METADATA_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "tokenizer.model",
)


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message says what is wrong and what to do."""


def copy_hf_metadata(hf_dir: str | Path, out_dir: str | Path) -> None:
    """Copy the config, generation config and tokenizer files of `hf_dir` (not its weights) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in HF_METADATA_FILES:
        source = Path(hf_dir) / name
        if source.is_file():
            shutil.copy2(source, out / name)


def write_manifest(directory: str | Path, info: dict[str, Any]) -> None:
    """Record every file under `directory` with its size, plus `info`; call it after everything else is written."""
    root = Path(directory)
    files = {
        str(path.relative_to(root)): path.stat().st_size
        for path in sorted(root.rglob("*")) if path.is_file() and path.name != MANIFEST
    }
    (root / MANIFEST).write_text(json.dumps({"format": FORMAT, **info, "files": files}, indent=2))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming the problem otherwise."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if root.name.startswith(".incomplete_"):
        raise CheckpointError(f"{root} is a checkpoint that was still being written (the run stopped before it was "
                              "complete); use an earlier step_* directory")
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        if (root / "checkpoints").is_dir():
            raise CheckpointError(f"{root} is a run directory, not a checkpoint; pass one of its checkpoints, e.g. "
                                  f"{root / 'checkpoints' / 'step_000010'}")
        raise CheckpointError(f"{root} is not an rlsearch checkpoint (no {MANIFEST}); checkpoints are the step_* "
                              "directories under RUN/checkpoints, or the output of `rlsearch convert hf-to-mcore`")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{manifest_path} is damaged ({error})") from error
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{root}: unknown checkpoint format {manifest.get('format')!r} (expected {FORMAT})")
    for name, size in manifest["files"].items():
        path = root / name
        if not path.is_file():
            raise CheckpointError(f"{root} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise CheckpointError(f"{root} is damaged: {name} has {path.stat().st_size} bytes, expected {size}")
    return manifest
