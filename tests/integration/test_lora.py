"""LoRA adapters on the Megatron actor (actor.lora, rlsearch.megatron.lora) on the tiny Qwen2 at TP1, TP2, PP2, CP2.

Each layout scores a packed batch, takes two GRPO steps (the first moves only B, which starts at zero; the second
gives A a gradient too) and exports its weights. The checks: at step 0 the adapted model is the base model; only the
adapters train (no gradient or optimizer state for the base, its weights bit-identical after the steps); TP2, PP2 and
CP2 give TP1's logprobs, gradients and trained adapters; the exported weights are W + (alpha / rank) B A in fp32 under
the HF names, the adapters themselves not exported; and the reference policy (algo.kl_coef > 0) is the base model, with
no second model built. A checkpoint saved at TP1 resumes at TP2; both layouts' checkpoints convert to the merged HF
model and to a PEFT adapter that peft loads onto the base model with the same logits. Layout runs are cached per
module: each group of ranks starts once."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlsearch.checkpoint import HFExport, mcore_to_hf
from rlsearch.checkpoint.layout import MODEL_DIR
from rlsearch.config import AlgoConfig
from rlsearch.config.schema import LoRAConfig
from rlsearch.memory import ModelShape
from rlsearch.memory.shape import LORA_TARGETS, adapter_parameters
from tests.integration.actor_helpers import (
    actor_spec,
    hf_logprobs,
    max_diff,
    save_lora_checkpoint,
    scored_batch,
    sent_adapters,
    sent_tensors,
)
from tests.integration.convert_checks import converted_tensors

LORA = LoRAConfig(rank=4, alpha=8.0)
SCALE = LORA.alpha / LORA.rank
# name -> (tp, pp, other actor settings); cp2 splits each sequence over two ranks
LAYOUTS = {"tp1": (1, 1, {}), "tp2": (2, 1, {}), "pp2": (1, 2, {}), "cp2": (1, 1, {"cp": 2})}
# Adam's first steps move each adapter element by about lr: large enough that the trained adapters change the
# logprobs visibly (the parity checks then compare something)
SETTINGS = {"lora": LORA, "lr": 1e-3}
TOLERANCE = 1e-5  # layouts against TP1: logprobs, gradients, adapters, merged weights (float32 sums in other orders)


@dataclass
class LoRARun:
    logprobs_before: list[list[float]]
    reference_before: list[list[float]]  # the reference policy (the base model) at step 0
    logprobs_after: list[list[float]]
    reference_after: list[list[float]]
    metrics: list[dict[str, float]]  # of the two steps
    ranks_before: list[dict]  # `_rank_states`
    ranks_after: list[dict]
    exported: dict[str, torch.Tensor]  # hf_state_dict after the steps (mbridge's export)
    sent: dict[str, torch.Tensor]  # what the weight sync sends after the steps (the rank-local export)
    adapters: dict[str, torch.Tensor]  # what an adapter sync sends after the steps (actor.lora.sync=adapter)


def _rank_states(group) -> list[dict]:
    """Per rank, in rank order: its adapter factors and their gradients by global layer and target, its base weights,
    and what is trained."""

    def rank_state(worker) -> dict:  # run inside the rank (a nested function: Ray sends its code, not its name)
        from megatron.core import parallel_state as ps

        from rlsearch.megatron.lora import TARGET_MODULES, is_adapter

        factors, grads, base = {}, {}, {}
        for index, chunk in enumerate(worker.model):
            for layer in chunk.module.decoder.layers:
                for target, (parent, name) in TARGET_MODULES.items():
                    adapter = getattr(getattr(layer, parent), name).lora
                    for factor in ("a", "b"):
                        parameter = getattr(adapter, factor)
                        key = f"{layer.layer_number}.{target}.{factor}"
                        factors[key] = parameter.detach().clone()
                        if getattr(parameter, "main_grad", None) is not None:
                            grads[key] = parameter.main_grad.detach().clone()
            base.update({f"{index}.{name}": p.detach().clone() for name, p in chunk.module.named_parameters()
                         if not is_adapter(p)})
        parameters = [p for chunk in worker.model for p in chunk.module.parameters()]
        optimizers = getattr(worker.training.optimizer, "chained_optimizers", [worker.training.optimizer])
        optimized = [p for part in optimizers for param_group in part.optimizer.param_groups
                     for p in param_group["params"]]
        with_state = [p for part in optimizers for p in part.optimizer.state]
        adapter_ids = {id(p) for p in parameters if is_adapter(p)}
        return {
            "tp_rank": ps.get_tensor_model_parallel_rank(), "factors": factors, "grads": grads, "base": base,
            "trainable_base": [name for chunk in worker.model for name, p in chunk.module.named_parameters()
                               if not is_adapter(p) and (p.requires_grad or p.grad is not None
                                                         or getattr(p, "main_grad", None) is not None)],
            "optimized_is_adapters": {id(p) for p in optimized} == adapter_ids,
            "state_only_adapters": {id(p) for p in with_state} <= adapter_ids,
            "second_model": worker.reference is not None,
        }

    return ray.get([worker.__ray_call__.remote(rank_state) for worker in group.workers])


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    samples, reference = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    return samples, reference


@pytest.fixture(scope="module")
def run_lora(rank_pool, tiny_model_dir, batch):
    samples, _ = batch
    cache: dict[str, LoRARun] = {}

    def run(name: str) -> LoRARun:
        if name in cache:
            return cache[name]
        tp, pp, extra = LAYOUTS[name]
        spec = replace(actor_spec(tiny_model_dir, tp, pp, 1, {**SETTINGS, **extra}), algo=AlgoConfig(kl_coef=0.01))
        with rank_pool.group(spec) as group:
            reference_before = group.compute_logprobs(samples, reference=True)
            trained = [replace(s, ref_logprobs=r) for s, r in zip(samples, reference_before)]
            logprobs_before = group.compute_logprobs(samples)
            ranks_before = _rank_states(group)
            metrics = [group.train_step(trained) for _ in range(2)]
            ranks_after = _rank_states(group)
            logprobs_after = group.compute_logprobs(samples)
            reference_after = group.compute_logprobs(samples, reference=True)
            exported = group.hf_state_dict()
            sent = sent_tensors(group, 64)
            adapters = sent_adapters(group)
        cache[name] = LoRARun(logprobs_before, reference_before, logprobs_after, reference_after, metrics,
                              ranks_before, ranks_after, exported, sent, adapters)
        return cache[name]

    return run


def _max_logprob_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item() for x, y in zip(a, b))


def _whole(ranks: list[dict], part: str) -> dict[str, torch.Tensor]:
    """The layout's adapters (`part`: factors or grads) as TP1 holds them: TP shards joined as Megatron splits them
    (a column-parallel B on its rows, a gated fc1's as gate and up halves; a row-parallel A on its columns), the
    copies every TP rank holds checked equal; pipeline stages' layers merged."""
    by_key: dict[str, dict[int, torch.Tensor]] = {}
    for rank in ranks:
        for key, tensor in rank[part].items():
            by_key.setdefault(key, {})[rank["tp_rank"]] = tensor
    whole = {}
    for key, shards in by_key.items():
        shards = [shards[tp] for tp in sorted(shards)]
        _, target, factor = key.split(".")
        if (factor, target) in (("b", "qkv"), ("b", "fc1")):
            if target == "fc1":
                halves = [shard.chunk(2) for shard in shards]
                whole[key] = torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
            else:
                whole[key] = torch.cat(shards)
        elif (factor, target) in (("a", "proj"), ("a", "fc2")):
            whole[key] = torch.cat(shards, dim=1)
        else:
            assert all(torch.equal(shard, shards[0]) for shard in shards), f"{key} differs between TP ranks"
            whole[key] = shards[0]
    return whole


def test_lora_step_zero_is_the_base_model(run_lora, batch):
    _, hf_reference = batch
    result = run_lora("tp1")
    # B is zero: the adapted model scores as its base (the reference policy: adapters off) and as HF transformers
    identity = _max_logprob_diff(result.logprobs_before, result.reference_before)
    print(f"\nstep 0, adapters on vs off: max |logprob diff| {identity:.1e}")
    assert identity <= 1e-6
    assert max((torch.tensor(a) - b).abs().max().item() for a, b in zip(result.logprobs_before, hf_reference)) < 1e-5
    assert all(torch.count_nonzero(t) == 0 for k, t in result.ranks_before[0]["factors"].items() if k.endswith(".b"))
    assert all(torch.count_nonzero(t) > 0 for k, t in result.ranks_before[0]["factors"].items() if k.endswith(".a"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_trains_only_the_adapters(run_lora, tiny_model_dir, layout):
    result = run_lora(layout)
    shape, (tp, pp, _) = ModelShape.from_model_dir(tiny_model_dir), LAYOUTS[layout]
    assert [m["actor/update_ok"] for m in result.metrics] == [1.0, 1.0]
    for before, after in zip(result.ranks_before, result.ranks_after):
        assert after["trainable_base"] == []  # no gradient of the base anywhere
        assert after["optimized_is_adapters"] and after["state_only_adapters"]  # Adam holds the adapters only
        assert after["second_model"] is False  # algo.kl_coef > 0 built no reference model
        # the memory plan counts the rank's adapters as it holds them
        assert sum(f.numel() for f in after["factors"].values()) == adapter_parameters(shape, tp, pp, LORA.rank,
                                                                                        LORA_TARGETS)
        assert set(after["base"]) == set(before["base"])
        assert all(torch.equal(after["base"][name], before["base"][name]) for name in before["base"])
        moved = max((after["factors"][k] - before["factors"][k]).abs().max().item() for k in before["factors"])
        assert moved > 1e-4
    # the trained policy moved; the reference (its base) did not
    assert _max_logprob_diff(result.logprobs_after, result.logprobs_before) > 1e-3
    assert _max_logprob_diff(result.reference_after, result.reference_before) == 0.0


@pytest.mark.parametrize("layout", ["tp2", "pp2", "cp2"])
def test_lora_layouts_give_tp1s_logprobs_gradients_and_adapters(run_lora, layout):
    baseline, result = run_lora("tp1"), run_lora(layout)
    grads, factors = (max_diff(_whole(result.ranks_after, part), _whole(baseline.ranks_after, part))
                      for part in ("grads", "factors"))
    print(f"\n{layout} vs tp1, max |diff|: logprobs "
          f"{_max_logprob_diff(result.logprobs_after, baseline.logprobs_after):.1e} after the steps, gradients "
          f"{grads:.1e}, adapters {factors:.1e}, merged weights {max_diff(result.exported, baseline.exported):.1e}")
    assert _max_logprob_diff(result.logprobs_before, baseline.logprobs_before) < TOLERANCE
    assert _max_logprob_diff(result.logprobs_after, baseline.logprobs_after) < TOLERANCE
    for step, (ours, theirs) in enumerate(zip(result.metrics, baseline.metrics)):
        for key in ("actor/policy_loss", "actor/kl_loss", "actor/grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], abs=TOLERANCE), (step, key)
    for part in ("grads", "factors"):
        ours, theirs = _whole(result.ranks_after, part), _whole(baseline.ranks_after, part)
        assert set(ours) == set(theirs) and len(theirs) == 2 * 4 * 2  # layers x targets x (A, B)
        assert max_diff(ours, theirs) < TOLERANCE, part
    grads = _whole(baseline.ranks_after, "grads")
    assert min(g.abs().max().item() for g in grads.values()) > 1e-6  # the second step: A's gradients too
    assert max_diff(result.exported, baseline.exported) < TOLERANCE


def test_lora_exports_the_merged_weights(run_lora, tiny_model_dir):
    """TP1's export after the steps: every HF weight of the model file and no other name, the adapted ones
    W + (alpha / rank) B A computed in fp32 from the rank's own adapters, bit for bit, the rest untouched; the weight
    sync sends the same tensors."""
    result = run_lora("tp1")
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    factors = result.ranks_after[0]["factors"]
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    expected = dict(original)
    for layer in range(config["num_hidden_layers"]):
        def delta(target: str, layer=layer) -> torch.Tensor:
            return SCALE * (factors[f"{layer + 1}.{target}.b"].float() @ factors[f"{layer + 1}.{target}.a"].float())

        prefix = f"model.layers.{layer}"
        # Megatron's fused qkv rows: per query group its query heads, then its key head, then its value head
        qkv = delta("qkv").view(groups, heads // groups + 2, head_dim, -1)
        fc1 = delta("fc1").chunk(2)  # gate rows, then up rows
        deltas = {
            "self_attn.q_proj": qkv[:, :-2].reshape(-1, qkv.shape[-1]),
            "self_attn.k_proj": qkv[:, -2].reshape(-1, qkv.shape[-1]),
            "self_attn.v_proj": qkv[:, -1].reshape(-1, qkv.shape[-1]),
            "self_attn.o_proj": delta("proj"), "mlp.gate_proj": fc1[0], "mlp.up_proj": fc1[1],
            "mlp.down_proj": delta("fc2"),
        }
        for module, change in deltas.items():
            name = f"{prefix}.{module}.weight"
            expected[name] = original[name].float() + change
    assert set(result.exported) == set(original)
    mismatched = [name for name in original if not torch.equal(result.exported[name], expected[name])]
    assert mismatched == []
    assert set(result.sent) == set(original)
    assert [name for name in original if not torch.equal(result.sent[name], result.exported[name])] == []
    adapted = [name for name in original if not torch.equal(result.exported[name], original[name])]
    assert len(adapted) == 7 * config["num_hidden_layers"]  # q, k, v, o, gate, up, down of every layer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_adapter_sync_sends_peft_factors_whose_product_is_the_merged_change(run_lora, tiny_model_dir, layout):
    """actor.lora.sync=adapter sends, per HF module, lora_A and lora_B under PEFT's names, whole whatever the layout
    (TP shards gathered, PP stages joined), and (alpha / rank) lora_B lora_A is exactly what the merged sync adds to
    that module's weight (the q/k/v split of the fused qkv rows, the gate/up split of fc1), within fp32 rounding;
    TP2's and PP2's factors are TP1's; the adapters are ~1/20 of the model's bytes or less."""
    result = run_lora(layout)
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    modules = {name.removeprefix("base_model.model.").split(".lora_")[0] for name in result.adapters}
    assert len(modules) == 7 * config["num_hidden_layers"]  # q, k, v, o, gate, up, down of every layer
    assert set(result.adapters) == {f"base_model.model.{m}.lora_{f}.weight" for m in modules for f in "AB"}
    worst = 0.0
    for module in modules:
        a, b = (result.adapters[f"base_model.model.{module}.lora_{f}.weight"] for f in "AB")
        assert a.shape[0] == b.shape[1] == LORA.rank
        change = result.sent[f"{module}.weight"].float() - original[f"{module}.weight"].float()
        worst = max(worst, (SCALE * (b.float() @ a.float()) - change).abs().max().item())
    assert worst < 1e-6, worst
    if layout != "tp1":
        assert max_diff(result.adapters, run_lora("tp1").adapters) < TOLERANCE
    model_bytes = sum(tensor.nbytes for tensor in original.values())
    assert sum(tensor.nbytes for tensor in result.adapters.values()) * 20 <= model_bytes


@dataclass
class LoRACheckpoint:
    path: Path
    weights: dict[str, torch.Tensor]  # the saving group's merged export (hf_state_dict) at the checkpoint
    logprobs: list[list[float]]  # the saving group's logprobs of the batch at the checkpoint


@dataclass
class LoRAResume:
    checkpoints: dict[str, LoRACheckpoint]  # tp1: saved after a step; tp2: the resumed run's after its next step
    loaded: dict[str, torch.Tensor]  # TP2's merged export right after loading the TP1 checkpoint
    second: dict[str, float]  # TP1's next step's metrics
    second_resumed: dict[str, float]  # TP2's, resumed
    uninterrupted: dict[str, torch.Tensor]  # TP1's merged export after its next step


@pytest.fixture(scope="module")
def lora_resume(rank_pool, tiny_model_dir, batch, module_tmp) -> LoRAResume:
    """A TP1 run's checkpoint after a step, resumed at TP2 for the next step, which TP1 also takes uninterrupted; the
    TP2 run saves a checkpoint after it. The checkpoints hold the adapters, split as each layout splits them, and
    their Adam state."""
    samples, _ = batch
    run_dir = module_tmp.mktemp("lora_run")

    # the second step pushes the other way: only with Adam's first moment restored do the two gradients mostly cancel
    reversed_samples = [replace(sample, advantage=-sample.advantage) for sample in samples]
    with rank_pool.group(actor_spec(tiny_model_dir, 1, 1, 1, SETTINGS)) as source:
        source.train_step(samples)
        tp1 = LoRACheckpoint(save_lora_checkpoint(run_dir, 1, source, tiny_model_dir, 1, LORA),
                             source.hf_state_dict(), source.compute_logprobs(samples))
        second = source.train_step(reversed_samples)
        uninterrupted = source.hf_state_dict()
    with rank_pool.group(actor_spec(tiny_model_dir, 2, 1, 1, SETTINGS)) as resumed:
        assert resumed.load_checkpoint(str(tp1.path / MODEL_DIR), restore_rng=False) == 1
        loaded = resumed.hf_state_dict()
        second_resumed = resumed.train_step(reversed_samples)
        tp2 = LoRACheckpoint(save_lora_checkpoint(run_dir, 2, resumed, tiny_model_dir, 2, LORA),
                             resumed.hf_state_dict(), resumed.compute_logprobs(samples))
    return LoRAResume({"tp1": tp1, "tp2": tp2}, loaded, second, second_resumed, uninterrupted)


@pytest.fixture(scope="module")
def lora_converted(lora_resume, module_tmp):
    """`rlsearch convert mcore-to-hf` of a layout's checkpoint (cached): the merged HF model, verified against the
    Megatron model, and the PEFT adapter, in one conversion."""
    root = module_tmp.mktemp("lora_converted")
    cache: dict[str, HFExport] = {}

    def convert(layout: str) -> HFExport:
        if layout not in cache:
            cache[layout] = mcore_to_hf(lora_resume.checkpoints[layout].path, root / f"{layout}_hf", verify=True,
                                        peft_adapter_dir=root / f"{layout}_peft")
        return cache[layout]

    return convert


def test_lora_checkpoint_from_tp1_resumes_at_tp2(lora_resume):
    """Saved at TP1 after a step, loaded at TP2, the next step is TP1's (the base weights are the model file's:
    frozen)."""
    saved = lora_resume.checkpoints["tp1"].weights
    assert max_diff(lora_resume.loaded, saved) < 1e-6
    assert lora_resume.second_resumed["actor/grad_norm"] == pytest.approx(lora_resume.second["actor/grad_norm"],
                                                                          abs=1e-6)
    assert max_diff(lora_resume.checkpoints["tp2"].weights, lora_resume.uninterrupted) < 1e-6
    assert max_diff(lora_resume.uninterrupted, saved) > 1e-5  # the second step moved the merged weights


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_lora_checkpoint_converts_merged(lora_resume, lora_converted, layout):
    """`rlsearch convert mcore-to-hf` writes the merged weights the saving group exported (TP2's shards gathered on
    load), the HF model's logits those of the Megatron model with its adapters."""
    converted, saved = lora_converted(layout), lora_resume.checkpoints[layout].weights
    assert converted.max_logit_diff < 1e-5
    merged = converted_tensors(converted.out_dir)
    assert set(merged) == set(saved)
    if layout == "tp1":
        assert all(torch.equal(merged[name], saved[name]) for name in saved)
    else:  # B A of the whole factors against the sum of TP2's shards' products: float32 sums in other orders
        assert max_diff(merged, saved) < 1e-6


def _causal_lm_logits(model, samples) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([sample.token_ids])).logits[0].float() for sample in samples]


def _logprobs_of(logits: list[torch.Tensor], samples) -> list[list[float]]:
    return [torch.log_softmax(row, -1)[sample.response_start - 1:-1].gather(
        1, torch.tensor(sample.token_ids[sample.response_start:])[:, None])[:, 0].tolist()
        for row, sample in zip(logits, samples)]


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_lora_checkpoint_exports_a_peft_adapter(lora_resume, lora_converted, tiny_model_dir, batch, layout):
    """--peft-adapter writes the adapters under PEFT's names for the HF model, the fused qkv and fc1 adapters split
    into q/k/v_proj and gate/up_proj (each the shared A and its rows of B; TP2's B shards gathered), lora_alpha / r the
    run's scale. peft loads it onto the base model with the merged model's logits and the actor's logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    samples, _ = batch
    converted = lora_converted(layout)
    peft_dir = converted.peft.adapter_dir
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    modules = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert (config["peft_type"], config["r"], config["lora_alpha"] / config["r"]) == ("LORA", LORA.rank, SCALE)
    assert config["target_modules"] == converted.peft.modules == modules
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    factors = load_file(str(peft_dir / "adapter_model.safetensors"))
    hf_config = json.loads((tiny_model_dir / "config.json").read_text())
    assert converted.peft.num_tensors == len(factors) == 2 * len(modules) * hf_config["num_hidden_layers"]
    # W + s B_i A of each HF module is the merged export's weight; the fused modules' A is one
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    merged = converted_tensors(converted.out_dir)
    worst = 0.0
    for layer in range(hf_config["num_hidden_layers"]):
        for module in modules:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{layer}.{parent}.{module}"
            a, b = (factors[f"base_model.model.{name}.lora_{factor}.weight"] for factor in "AB")
            assert a.shape[0] == b.shape[1] == LORA.rank and torch.count_nonzero(b) > 0
            weight = original[f"{name}.weight"].float() + SCALE * (b.float() @ a.float())
            worst = max(worst, (weight - merged[f"{name}.weight"]).abs().max().item())
        shared = [factors[f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_A.weight"] for parent, module
                  in (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"))]
        assert torch.equal(shared[0], shared[1]) and torch.equal(shared[0], shared[2])
    assert worst < 1e-6
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    base_logits = _causal_lm_logits(base, samples)
    adapted = _causal_lm_logits(PeftModel.from_pretrained(base, str(peft_dir)).eval(), samples)
    merged_logits = _causal_lm_logits(
        AutoModelForCausalLM.from_pretrained(converted.out_dir, dtype=torch.float32).eval(), samples)
    versus_merged = max((x - y).abs().max().item() for x, y in zip(adapted, merged_logits))
    versus_actor = _max_logprob_diff(_logprobs_of(adapted, samples), lora_resume.checkpoints[layout].logprobs)
    moved = max((x - y).abs().max().item() for x, y in zip(adapted, base_logits))
    print(f"\n{layout} PEFT adapter on the base model, max |diff|: logits vs the merged export {versus_merged:.1e}, "
          f"logprobs vs the actor {versus_actor:.1e}; logits moved {moved:.1e} from the base model's")
    assert versus_merged < 1e-5 and versus_actor < 1e-5
    assert moved > 1e-3  # the adapters change the model: the parity compares something
