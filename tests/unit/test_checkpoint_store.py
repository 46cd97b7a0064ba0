"""Run checkpoints on disk: complete-or-absent, pruned to the newest K, damaged ones skipped when resuming."""

from __future__ import annotations

import hashlib
import json

import pytest

from rlsearch.checkpoint import CheckpointError, CheckpointStore, load_run_checkpoint, read_manifest
from rlsearch.config import ConfigError, load_train_config
from tests.constants import REPO_ROOT

INFO = {
    "layout": {"tp": 1, "pp": 1, "dp": 1, "virtual_pipeline_stages": 0}, "architecture": "qwen2",
    "transformer_impl": "local",
}


def _hf_dir(tmp_path):
    hf = tmp_path / "hf_model"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    (hf / "tokenizer.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"weights are not copied")
    return hf


def _write_model(directory: str) -> None:
    from pathlib import Path

    (Path(directory) / "__0_0.distcp").write_bytes(b"x" * 1000)
    (Path(directory) / ".metadata").write_bytes(b"m" * 10)


def _save_steps(tmp_path, steps, keep=0):
    store = CheckpointStore(tmp_path / "run", keep=keep)
    hf = _hf_dir(tmp_path)
    for step in steps:
        store.save(step, _write_model, {"sampler": {"epoch": 0, "position": 4 * step}, "seed": 1}, hf, INFO)
    return store


def test_checkpoint_save_writes_a_complete_checkpoint_and_latest(tmp_path):
    store = _save_steps(tmp_path, [2])
    path = store.root / "step_000002"
    manifest = read_manifest(path)
    assert manifest["kind"] == "run" and manifest["step"] == 2 and manifest["layout"]["tp"] == 1
    assert set(manifest["files"]) == {"megatron/__0_0.distcp", "megatron/.metadata", "hf/config.json",
                                      "hf/tokenizer.json", "trainer_state.json"}  # HF metadata, not weights
    assert (store.root / "latest").read_text().strip() == "step_000002"
    assert not list(store.root.glob(".incomplete_*"))
    manifest, state = load_run_checkpoint(path)
    assert state == {"step": 2, "sampler": {"epoch": 0, "position": 8}, "seed": 1}


def test_checkpoint_keep_prunes_to_the_newest(tmp_path):
    store = _save_steps(tmp_path, [1, 2, 3, 4], keep=2)
    assert sorted(p.name for p in store.root.glob("step_*")) == ["step_000003", "step_000004"]


def test_resume_auto_skips_a_truncated_checkpoint_with_a_warning_naming_it(tmp_path):
    store = _save_steps(tmp_path, [2, 4, 6])
    with (store.root / "step_000006" / "megatron" / "__0_0.distcp").open("r+b") as handle:
        handle.truncate(500)
    (store.root / "step_000004" / "manifest.json").unlink()  # as if killed between the files and the manifest
    (store.root / ".incomplete_step_000008").mkdir()  # killed while writing: never a step_* dir
    path, skipped = store.newest_complete()
    assert path == store.root / "step_000002"
    assert len(skipped) == 2
    assert "step_000006" in skipped[0] and "megatron/__0_0.distcp has 500 bytes, expected 1000" in skipped[0]
    assert "step_000004" in skipped[1] and "no manifest.json" in skipped[1]


def test_resume_auto_in_a_fresh_run_dir_finds_nothing(tmp_path):
    assert CheckpointStore(tmp_path / "fresh").newest_complete() == (None, [])


def test_load_run_checkpoint_errors_say_what_is_wrong(tmp_path):
    store = _save_steps(tmp_path, [2])
    with pytest.raises(CheckpointError, match="run directory, not a checkpoint"):
        load_run_checkpoint(tmp_path / "run")
    staging = store.root / ".incomplete_step_000003"
    staging.mkdir()
    with pytest.raises(CheckpointError, match="still being written"):
        load_run_checkpoint(staging)
    manifest_path = store.root / "step_000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "kind": "model"}))
    with pytest.raises(CheckpointError, match="model weights only"):
        load_run_checkpoint(store.root / "step_000002")


def test_config_resume_path_is_checked_at_start_up(tmp_path):
    from rlsearch.trainer import GRPOTrainer

    config = REPO_ROOT / "examples" / "configs" / "search_grpo_tiny.yaml"
    with pytest.raises(ConfigError, match=r"'trainer.resume'.*not an rlsearch checkpoint"):
        GRPOTrainer(load_train_config(config, [f"trainer.resume={tmp_path}"]))
    assert load_train_config(config, ["trainer.resume=none"]).trainer.resume == "none"


def test_a_checkpoint_resumes_only_with_the_optimizer_kind_that_wrote_it(tmp_path):
    """The distributed optimizer's states and the plain optimizer's are laid out differently in a checkpoint: a run
    that switches actor.use_distributed_optimizer stops at start-up saying which to use."""
    from rlsearch.config import TrainConfig, to_dict
    from rlsearch.trainer import GRPOTrainer

    store = CheckpointStore(tmp_path / "run")
    saved = TrainConfig()
    saved.actor.use_distributed_optimizer = True
    state = {"sampler": {"epoch": 0, "position": 4}, "seed": 1, "config": to_dict(saved)}
    path = store.save(2, _write_model, state, _hf_dir(tmp_path), INFO)
    config = REPO_ROOT / "examples" / "configs" / "search_grpo_tiny.yaml"
    with pytest.raises(ConfigError, match=r"'actor\.use_distributed_optimizer' is false but the checkpoint .* was "
                                          r"written with true: .* Resume with actor\.use_distributed_optimizer=true"):
        GRPOTrainer(load_train_config(config, [f"trainer.resume={path}"]))


def _zero(path) -> None:
    """Overwrite a file with as many zero bytes: its size still matches the manifest."""
    path.write_bytes(bytes(path.stat().st_size))


def test_a_zeroed_shard_of_the_same_size_is_told_by_its_sha256_and_resume_takes_the_checkpoint_before(tmp_path):
    store = _save_steps(tmp_path, [2, 4])
    manifest = read_manifest(store.root / "step_000004")
    assert manifest["sha256"]["megatron/__0_0.distcp"] == hashlib.sha256(b"x" * 1000).hexdigest()
    assert manifest["model_shape"] == {"model_type": "qwen2"}
    _zero(store.root / "step_000004" / "megatron" / "__0_0.distcp")
    assert store.newest_complete() == (store.root / "step_000004", [])  # sizes only: cheap, for the died message
    path, skipped = store.newest_complete(check_contents=True)
    assert path == store.root / "step_000002"
    assert skipped == [
        f"skipping checkpoint step_000004: {store.root / 'step_000004'} is damaged: megatron/__0_0.distcp no longer "
        "holds the bytes it was saved with (its sha256 differs from the manifest's); use an earlier checkpoint (a "
        "step_* dir beside it)"]
    with pytest.raises(CheckpointError, match=r"step_000004 is damaged: megatron/__0_0\.distcp no longer holds"):
        load_run_checkpoint(store.root / "step_000004", check_contents=True)


def test_a_checkpoint_from_before_the_sha256_were_recorded_is_checked_by_size(tmp_path):
    store = _save_steps(tmp_path, [2])
    manifest_path = store.root / "step_000002" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["sha256"], manifest["model_shape"]
    manifest_path.write_text(json.dumps(manifest))
    _zero(store.root / "step_000002" / "megatron" / "__0_0.distcp")
    assert store.newest_complete(check_contents=True) == (store.root / "step_000002", [])


def test_a_failed_checkpoint_load_names_each_ranks_root_error_without_torchs_advice():
    """torch.distributed.checkpoint reports a failed load as 'CheckpointException ranks:dict_keys([0, 1])'; its
    per-rank failures are what the message tells."""
    import pickle
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from rlsearch.megatron.parallel import load_failures

    weights_only = pickle.UnpicklingError(
        "Weights only load failed. This file can still be loaded, to do so you have two options, do those steps only "
        "if you trust the source of the checkpoint.\n\t(1) Re-running `torch.load` with `weights_only` set to "
        "`False` will likely succeed\nPlease file an issue: WeightsUnpickler error: \n\nUnsupported operand 0\n\nCheck "
        "the documentation of torch.load")
    try:
        raise RuntimeError("reading __1_0.distcp failed") from ValueError(
            "Size mismatch between saved torch.Size([4, 4]) and current: torch.Size([8, 4]) for w")
    except RuntimeError as error:
        wrapped = error
    stack = traceback.StackSummary.from_list([])
    error = CheckpointException("CheckpointException", {1: (wrapped, stack), 0: (weights_only, stack)})
    assert str(error).startswith("CheckpointException ranks:dict_keys([1, 0])")
    assert load_failures(error) == (
        "rank 0: UnpicklingError: Unsupported operand 0; rank 1: ValueError: Size mismatch between saved "
        "torch.Size([4, 4]) and current: torch.Size([8, 4]) for w")
    assert load_failures(ValueError("Global shape mismatch for loaded (8, 4) and expected (4, 4)")) == (
        "ValueError: Global shape mismatch for loaded (8, 4) and expected (4, 4)")


def _model_checkpoint(tmp_path, config):
    """A converted-model checkpoint (hf-to-mcore's manifest) of an HF dir with `config`."""
    hf = tmp_path / "hf_model"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps(config))
    info = {**INFO, "dtype": "float32", "contents": ["model"]}
    return CheckpointStore(tmp_path / "run").save(2, _write_model, {}, hf, info)


def test_convert_refuses_a_zeroed_checkpoint_naming_the_file_not_the_base_model(tmp_path):
    from rlsearch.checkpoint import mcore_to_hf

    checkpoint = _model_checkpoint(tmp_path, {"model_type": "qwen2"})
    _zero(checkpoint / "megatron" / ".metadata")
    with pytest.raises(CheckpointError) as refused:
        mcore_to_hf(checkpoint, tmp_path / "out")
    assert str(refused.value) == (
        f"{checkpoint} is damaged: megatron/.metadata no longer holds the bytes it was saved with (its sha256 differs "
        "from the manifest's); use an earlier checkpoint (a step_* dir beside it)")
    assert not list(tmp_path.glob("*out*"))


def test_convert_refuses_a_base_model_of_another_shape_before_a_rank_starts(tmp_path):
    from rlsearch.checkpoint import mcore_to_hf

    checkpoint = _model_checkpoint(tmp_path, {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 256})
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 384}))
    with pytest.raises(CheckpointError) as refused:
        mcore_to_hf(checkpoint, tmp_path / "out", base_hf_dir=base)
    assert str(refused.value) == (
        f"{checkpoint} holds another model than {base} describes (intermediate_size 256 there, 384 here); pass the "
        "base model the run was trained from as --base-hf-dir, or leave it out to take the checkpoint's own hf/ copy")
    assert not list(tmp_path.glob("*out*"))
