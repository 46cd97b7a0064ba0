"""A run checkpoint resumes only with the actor.lora it was trained with: its adapters (or their absence) are part of
its model and of Adam's state; one trained without adapters has no PEFT adapter to export."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsearch.checkpoint import CheckpointError, CheckpointStore, mcore_to_hf
from rlsearch.cli import main
from rlsearch.config import ConfigError, load_train_config, to_dict
from rlsearch.trainer.checkpoints import checkpoint_to_resume


def _saved_run(tmp_path: Path, overrides: list[str]) -> CheckpointStore:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    config = load_train_config(None, overrides)
    state = {"sampler": {"epoch": 0, "position": 4}, "seed": config.trainer.seed, "config": to_dict(config)}
    store = CheckpointStore(tmp_path / "run")
    store.save(1, lambda directory: (Path(directory) / "__0_0.distcp").write_bytes(b"x"), state, hf,
               {"layout": {"tp": 1, "pp": 1, "dp": 1}, "architecture": "qwen2", "transformer_impl": "local",
                "dtype": "float32", "contents": ["model"]})
    return store


def test_a_lora_checkpoint_resumes_with_its_adapters_only(tmp_path):
    store = _saved_run(tmp_path, ["actor.lora.rank=8", "actor.lora.targets=[qkv,fc2]"])
    same = ["trainer.resume=auto", "actor.lora.rank=8", "actor.lora.targets=[fc2,qkv]"]
    assert checkpoint_to_resume(load_train_config(None, same), store).step == 1
    path = store.root / "step_000001"
    with pytest.raises(ConfigError) as refused:
        checkpoint_to_resume(load_train_config(None, ["trainer.resume=auto"]), store)
    assert str(refused.value) == (
        f"'actor.lora' is off but the checkpoint {path} was trained with rank 8, alpha 16.0, targets fc2,qkv: the "
        "adapters are part of its model and of Adam's state. Resume with the same actor.lora rank, alpha and "
        "targets, or start a fresh run from its merged weights (rlsearch convert mcore-to-hf, then model.path)")
    with pytest.raises(ConfigError, match=r"'actor\.lora' is rank 8, alpha 32\.0, targets fc2,qkv but the checkpoint"):
        checkpoint_to_resume(load_train_config(None, [*same, "actor.lora.alpha=32"]), store)


def test_a_full_weight_checkpoint_does_not_resume_under_adapters(tmp_path):
    store = _saved_run(tmp_path, [])
    with pytest.raises(ConfigError, match=r"'actor\.lora' is rank 4, alpha 16\.0, targets fc1,fc2,proj,qkv but the "
                                          r"checkpoint .* was trained with off"):
        checkpoint_to_resume(load_train_config(None, ["trainer.resume=auto", "actor.lora.rank=4"]), store)


def test_a_full_weight_checkpoint_has_no_peft_adapter_to_export(tmp_path, capsys):
    store = _saved_run(tmp_path, [])
    path = store.root / "step_000001"
    adapter = tmp_path / "adapter"
    message = (f"{path} holds no LoRA adapters (its manifest.json has no actor.lora: the run trained every weight), "
               "so there is no PEFT adapter to write; convert its weights with --out alone")
    with pytest.raises(CheckpointError) as refused:
        mcore_to_hf(path, None, peft_adapter_dir=adapter)
    assert str(refused.value) == message
    assert main(["convert", "mcore-to-hf", "--ckpt", str(path), "--peft-adapter", str(adapter)]) == 2
    assert capsys.readouterr().err == f"rlsearch convert: {message}\n"
    assert not adapter.exists() and not (tmp_path / ".incomplete_adapter").exists()
