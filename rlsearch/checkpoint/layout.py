"""What a checkpoint directory holds, and how a complete one is told from a partial or damaged one.

    step_000004/
      megatron/           Megatron distributed checkpoint (torch_dist): model [+ optimizer, scheduler, RNG]
      critic/             the same of the critic (algo.advantage=gae runs): its value model's checkpoint
      hf/                 the model's HF config, generation config and tokenizer (no weights): enough to
                          rebuild the architecture and to write a HuggingFace dir from the weights
      trainer_state.json  step, data-loader position, sampling seed, the run config (run checkpoints only)
      manifest.json       written last: format, parallel layout, contents, the model's shape (hf/config.json's
                          architecture, sizes, layers, heads, experts), and every file with its size and sha256

A directory without a manifest, or whose files no longer match it (deleted, truncated), is not complete; one whose
file contents differ from their sha256 (zeroed, overwritten) is damaged, a check that reads every file and so is made
where a checkpoint is about to be loaded. Checkpoints written before the sha256 were recorded are checked by size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ..files import file_sha256

MODEL_DIR = "megatron"
CRITIC_DIR = "critic"
HF_DIR = "hf"
TRAINER_STATE = "trainer_state.json"
RUBRIC_BUFFER = "rubric_buffer.json"  # a run's evolving rubrics (reward.rubric.evolve), beside the trainer state
MANIFEST = "manifest.json"
FORMAT = "rlsearch-checkpoint/1"
_USE_ANOTHER = "use an earlier checkpoint (a step_* dir beside it)"

# the config.json keys that decide the shapes of a model's weights (the expert counts under each architecture's name)
MODEL_SHAPE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
)

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


def model_shape(hf_dir: str | Path) -> dict[str, Any]:
    """The MODEL_SHAPE_KEYS of the config.json in `hf_dir` ({} without one)."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {key: config[key] for key in MODEL_SHAPE_KEYS if key in config}


def checkpoint_model_shape(directory: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The shape of the model a checkpoint holds: its manifest's, or (checkpoints from before it was recorded) that
    of the config in its hf/ dir."""
    return manifest.get("model_shape") or model_shape(Path(directory) / HF_DIR)


def shape_differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """'key saved there, value here' for each shape key the two models both give and differ in."""
    return [f"{key} {saved[key]!r} there, {here[key]!r} here" for key in MODEL_SHAPE_KEYS
            if key in saved and key in here and saved[key] != here[key]]


def write_manifest(directory: str | Path, info: dict[str, Any]) -> None:
    """Record every file under `directory` with its size and sha256, the model shape of its hf/ dir, plus `info`;
    call it after everything else is written."""
    root = Path(directory)
    paths = [path for path in sorted(root.rglob("*")) if path.is_file() and path.name != MANIFEST]
    manifest = {
        "format": FORMAT, "model_shape": model_shape(root / HF_DIR), **info,
        "files": {str(path.relative_to(root)): path.stat().st_size for path in paths},
        "sha256": {str(path.relative_to(root)): file_sha256(path) for path in paths},
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2))


def read_manifest(directory: str | Path, check_contents: bool = False) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming the problem otherwise. `check_contents`: every
    file's sha256 too (a checkpoint about to be loaded)."""
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
            raise CheckpointError(f"{root} is incomplete: {name} is missing; {_USE_ANOTHER}")
        if path.stat().st_size != size:
            raise CheckpointError(f"{root} is damaged: {name} has {path.stat().st_size} bytes, expected {size}; "
                                  f"{_USE_ANOTHER}")
    for name, expected in manifest.get("sha256", {}).items() if check_contents else ():
        if file_sha256(root / name) != expected:
            raise CheckpointError(f"{root} is damaged: {name} no longer holds the bytes it was saved with (its sha256 "
                                  f"differs from the manifest's); {_USE_ANOTHER}")
    return manifest
