"""Checkpoint conversion HF <-> Megatron: bit-exact round trips through sharded layouts, the converted model's logits
against Megatron's, dtype conversion, the CLI's errors on bad input, and the toolkit wrapper.

Every conversion starts its Megatron ranks and builds and saves their models, so the TP2PP2 checkpoint is written once
for the module."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlsearch.checkpoint import CheckpointError, hf_to_mcore, mcore_to_hf, read_manifest
from rlsearch.checkpoint.layout import HF_METADATA_FILES
from tests.integration.convert_checks import assert_bit_exact, convert_cli, converted_tensors

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tp2pp2_checkpoint(tiny_model_dir, module_tmp) -> Path:
    started = time.perf_counter()
    checkpoint = hf_to_mcore(tiny_model_dir, module_tmp.mktemp("convert") / "tp2pp2", tp=2, pp=2)
    print(f"hf_to_mcore tp2pp2: {time.perf_counter() - started:.1f} s")
    return checkpoint


def test_round_trip_tp2pp2_bit_exact_and_verified(tp2pp2_checkpoint, tiny_model_dir, tmp_path):
    manifest = read_manifest(tp2pp2_checkpoint)
    assert manifest["kind"] == "model" and manifest["contents"] == ["model"] and manifest["step"] is None
    assert manifest["layout"] == {"tp": 2, "pp": 2, "dp": 1, "virtual_pipeline_stages": 0}
    assert (manifest["architecture"], manifest["dtype"]) == ("qwen2", "float32")
    shard_files = [path.name for path in (tp2pp2_checkpoint / "megatron").glob("*.distcp")]
    assert {int(re.fullmatch(r"__(\d+)_\d+\.distcp", name).group(1)) for name in shard_files} == {0, 1, 2, 3}
    assert (tp2pp2_checkpoint / "hf" / "config.json").is_file()
    assert not list((tp2pp2_checkpoint / "hf").glob("*.safetensors"))

    started = time.perf_counter()
    # shards of at most 4 MiB: the two 8.1 MiB embedding matrices get one each, the layers share the middle one
    result = mcore_to_hf(tp2pp2_checkpoint, tmp_path / "hf", verify=True, max_shard_bytes=4 * 2**20)
    print(f"mcore_to_hf with verify: {time.perf_counter() - started:.1f} s, max |logit diff| {result.max_logit_diff}")
    assert result.max_logit_diff < 1e-5
    assert (result.num_tensors, result.num_shards, result.dtype) == (27, 3, "float32")
    assert_bit_exact(converted_tensors(result.out_dir), load_file(str(tiny_model_dir / "model.safetensors")))
    for name in HF_METADATA_FILES:
        assert (result.out_dir / name).is_file() == (tiny_model_dir / name).is_file(), name
    assert json.loads((result.out_dir / "config.json").read_text())["dtype"] == "float32"
    assert not list(tmp_path.glob(".incomplete_*"))


def test_round_trip_tied_embeddings_tp1pp2(tiny_model_dir, tmp_path):
    """A tied-embedding Qwen2 (the tiny model with lm_head dropped) split over two pipeline stages: the shared matrix
    lives on both stages and must come back once, as model.embed_tokens.weight."""
    tied = tmp_path / "tied"
    tied.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, tied / path.name)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})

    started = time.perf_counter()
    checkpoint = hf_to_mcore(tied, tmp_path / "tp1pp2", tp=1, pp=2)
    converted = mcore_to_hf(checkpoint, tmp_path / "hf")
    print(f"tied round trip tp1pp2: {time.perf_counter() - started:.1f} s")
    assert read_manifest(checkpoint)["layout"]["pp"] == 2
    assert_bit_exact(converted_tensors(converted.out_dir), weights)


def test_convert_bf16_through_mg2hf_wrapper(tp2pp2_checkpoint, tiny_model_dir, tmp_path):
    started = time.perf_counter()
    run = subprocess.run(
        [str(REPO_ROOT / "toolkits" / "ckpt_convertor" / "mg2hf.sh"), str(tp2pp2_checkpoint), str(tmp_path / "hf"),
         str(tiny_model_dir), "--dtype", "bf16"], capture_output=True, text=True, timeout=300,
    )
    print(f"mg2hf.sh --dtype bf16: {time.perf_counter() - started:.1f} s")
    assert run.returncode == 0, run.stderr
    assert f"wrote HuggingFace model {tmp_path / 'hf'}: 27 tensors" in run.stdout
    assert "bfloat16" in run.stdout
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    assert_bit_exact(converted_tensors(tmp_path / "hf"), {n: t.to(torch.bfloat16) for n, t in original.items()})
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def _not_a_checkpoint(tmp_path: Path, _checkpoint: Path) -> tuple[list[str], str]:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    return ["mcore-to-hf", "--ckpt", str(tmp_path / "notes")], f"{tmp_path / 'notes'} is not an rlsearch checkpoint"


def _incomplete(tmp_path: Path, checkpoint: Path) -> tuple[list[str], str]:
    staging = tmp_path / "checkpoints" / ".incomplete_step_000002"
    shutil.copytree(checkpoint / "hf", staging / "hf")
    (staging / "megatron").mkdir()
    return ["mcore-to-hf", "--ckpt", str(staging)], f"{staging} is a checkpoint that was still being written"


def _truncated(tmp_path: Path, checkpoint: Path) -> tuple[list[str], str]:
    damaged = tmp_path / "step_000004"
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "megatron" / "__2_0.distcp"
    with shard.open("r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    return ["mcore-to-hf", "--ckpt", str(damaged)], f"{damaged} is damaged: megatron/__2_0.distcp has"


def _zeroed(tmp_path: Path, checkpoint: Path) -> tuple[list[str], str]:
    damaged = tmp_path / "step_000006"
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "megatron" / "__2_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # the size it was saved with
    return ["mcore-to-hf", "--ckpt", str(damaged)], (
        f"{damaged} is damaged: megatron/__2_0.distcp no longer holds the bytes it was saved with (its sha256 differs "
        "from the manifest's); use an earlier checkpoint (a step_* dir beside it)")


def _unsupported_architecture(tmp_path: Path, _checkpoint: Path) -> tuple[list[str], str]:
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return ["hf-to-mcore", "--hf-dir", str(gpt2), "--tp", "2"], (
        f"unsupported architecture 'gpt2' in {gpt2}; supported: llama, qwen2, qwen3"
    )


def _no_critic(_tmp_path: Path, checkpoint: Path) -> tuple[list[str], str]:
    return ["mcore-to-hf", "--ckpt", str(checkpoint), "--critic"], (
        f"{checkpoint} holds no critic (contents: ['model']): only a run with algo.advantage=gae trains one")


@pytest.mark.parametrize("make_case", [_not_a_checkpoint, _incomplete, _truncated, _zeroed, _unsupported_architecture,
                                       _no_critic],
                         ids=["not-a-checkpoint", "incomplete", "truncated", "zeroed", "unsupported-architecture",
                              "no-critic"])
def test_convert_cli_rejects_bad_input(make_case, tp2pp2_checkpoint, tmp_path):
    args, message = make_case(tmp_path, tp2pp2_checkpoint)
    run = convert_cli(*args, "--out", str(tmp_path / "out"))
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("rlsearch convert: ") and message in run.stderr
    assert "Traceback" not in run.stderr and not run.stdout
    assert not (tmp_path / "out").exists()


def test_convert_reports_a_rank_error_in_the_caller(tp2pp2_checkpoint, tmp_path):
    """A damaged checkpoint from before the manifest's sha256 fails inside the conversion rank; the caller gets each
    rank's error, not torch's 'CheckpointException ranks:dict_keys([0])', and is told it is the checkpoint's."""
    damaged = tmp_path / "step_000002"
    shutil.copytree(tp2pp2_checkpoint, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["sha256"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    for shard in (damaged / "megatron").glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))
    with pytest.raises(CheckpointError) as refused:
        mcore_to_hf(damaged, tmp_path / "out")
    message = str(refused.value)
    assert message == (
        f"cannot load the checkpoint {damaged / 'megatron'} (rank 0: UnpicklingError: Unsupported operand 0); the "
        "checkpoint is damaged (it predates the sha256 in manifest.json that tell it) or not of the model its hf/ dir "
        "describes: convert an earlier checkpoint (a step_* dir beside it)")
    assert "weights_only" not in message and "CheckpointException" not in message
    assert not list(tmp_path.glob("*out*"))
