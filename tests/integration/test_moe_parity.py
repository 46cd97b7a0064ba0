"""Mixture-of-experts policies (Qwen3-MoE, Qwen2-MoE with its gated shared expert) in the Megatron actor, against
HF transformers and across expert-parallel layouts: per-token logprobs, router and expert gradients, the bridge's
rank-local export (each expert sent once, by its owner) and three GRPO steps whose losses agree layout to layout.

Tiny random models (8 experts, top-2, router initialised N(0, 0.5) so routing is decisive) with the real tokenizer.
Every layout of a model starts once per module.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import ray
import torch
from safetensors.torch import load_file

from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch, sent_tensors
from tests.models import MOE_ARCHITECTURES, TEST_VOCAB_RANKS

pytestmark = pytest.mark.memory_heavy  # holds several GiB at once: never beside another such module

# name -> (pp, dp, ep)
LAYOUTS = {"ep1": (1, 1, 1), "ep2": (1, 2, 2), "pp2ep2": (2, 2, 2)}
STEPS = 3
# (architecture, layout) pairs run: pipeline stages do not depend on the kind of MoE layer (suite time)
CASES = [(arch, layout) for arch in MOE_ARCHITECTURES for layout in LAYOUTS
         if (arch, layout) != ("qwen2_moe", "pp2ep2")]


@pytest.fixture(scope="module")
def batches(moe_model_dirs):
    return {arch: scored_batch(lambda samples, d=d: hf_logprobs(d, samples)) for arch, d in moe_model_dirs.items()}


@dataclass
class MoERun:
    stage_senders: list[int]  # ranks per stage taking part in the export
    sent: dict[str, torch.Tensor]
    logprobs: list[list[float]]
    losses: list[float]
    grad_norms: list[float]
    trained: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def run_layout(rank_pool, moe_model_dirs, batches):
    cache: dict[tuple[str, str], MoERun] = {}

    def run(arch: str, layout: str) -> MoERun:
        if (arch, layout) not in cache:
            pp, dp, ep = LAYOUTS[layout]
            samples, _ = batches[arch]
            with rank_pool.group(actor_spec(moe_model_dirs[arch], 1, pp, dp, {"ep": ep})) as group:
                sent = sent_tensors(group, 64)
                logprobs = group.compute_logprobs(samples)
                losses, grad_norms = [], []
                for _ in range(STEPS):
                    metrics = group.train_step(samples)
                    losses.append(metrics["actor/policy_loss"])
                    grad_norms.append(metrics["actor/grad_norm"])
                cache[(arch, layout)] = MoERun(
                    [len(workers) for workers in group.stage_workers()], sent, logprobs, losses, grad_norms,
                    group.hf_state_dict(),
                )
        return cache[(arch, layout)]

    return run


@pytest.mark.parametrize("arch,layout", CASES)
def test_moe_logprob_parity_with_hf(run_layout, batches, arch, layout):
    _, reference = batches[arch]
    result = run_layout(arch, layout)
    worst = max((torch.tensor(a) - b).abs().max().item() for a, b in zip(result.logprobs, reference))
    assert worst <= 1e-5


@pytest.mark.parametrize("arch,layout", CASES)
def test_moe_bridge_sends_each_expert_once_bit_exact(run_layout, moe_model_dirs, arch, layout):
    result = run_layout(arch, layout)
    pp, _, ep = LAYOUTS[layout]
    assert result.stage_senders == [ep] * pp  # the sender and its expert-parallel peers, per stage
    original = load_file(str(moe_model_dirs[arch] / "model.safetensors"))
    assert set(result.sent) == set(original)
    for name, tensor in original.items():
        assert torch.equal(result.sent[name], tensor), name


@pytest.mark.parametrize("arch,layout", [case for case in CASES if case[1] != "ep1"])
def test_moe_expert_parallel_losses_equal_ep1(run_layout, arch, layout):
    baseline, result = run_layout(arch, "ep1"), run_layout(arch, layout)
    assert baseline.losses[0] != pytest.approx(baseline.losses[-1], abs=1e-4)  # the steps move the policy
    assert result.losses == pytest.approx(baseline.losses, abs=1e-5)
    assert result.grad_norms == pytest.approx(baseline.grad_norms, rel=1e-4)
    worst = max((result.trained[n] - baseline.trained[n]).abs().max().item() for n in baseline.trained)
    assert worst <= 1e-5


@ray.remote(num_cpus=1, max_calls=1)  # a fresh process: Megatron's parallel state is process-global
def _megatron_gradients(model_dir: str, rank: int, world_size: int, rendezvous: str, ep: int,
                        token_ids: list[list[int]]) -> dict[str, torch.Tensor] | None:
    """Gradients of the summed next-token cross-entropy of `token_ids` (every rank the same batch) in a Megatron MoE
    at expert-parallel size `ep`, exported under HF names by the bridge (rank 0; None elsewhere)."""
    from megatron.core import parallel_state as ps

    from rlsearch.megatron.model import build_model_chunks, export_hf_named, make_bridge
    from rlsearch.megatron.parallel import init_megatron_parallel

    torch.set_num_threads(1)
    init_megatron_parallel(rank, world_size, rendezvous, ep=ep, backend="gloo")
    bridge = make_bridge(model_dir, torch.float32, "local", on_cpu=True)
    chunks = build_model_chunks(bridge)
    bridge.load_weights(chunks, model_dir)
    model = chunks[0]
    tokens = torch.tensor(token_ids)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(inputs.shape[1]).expand_as(inputs).contiguous()
    model(inputs, positions, None, labels=labels).sum().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            # every rank scored the whole batch, so each expert saw its tokens once per expert-parallel rank
            scale = ep if not getattr(parameter, "allreduce", True) else 1
            parameter.copy_(parameter.grad / scale)
    grads = {name: tensor.clone() for name, tensor in export_hf_named(bridge, chunks)}
    is_first = ps.get_data_parallel_rank() == 0
    torch.distributed.destroy_process_group()
    return grads if is_first and rank == 0 else None


@pytest.mark.parametrize("arch,ep", [("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen2_moe", 1)])
def test_moe_router_and_expert_gradient_parity_with_hf(ray_local, moe_model_dirs, arch, ep):
    from transformers import AutoModelForCausalLM

    from rlsearch.rendezvous import Rendezvous

    model_dir = moe_model_dirs[arch]
    token_ids = torch.randint(0, TEST_VOCAB_RANKS, (2, 41), generator=torch.Generator().manual_seed(3)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.config._experts_implementation = "eager"
    logits = hf(torch.tensor(token_ids)[:, :-1]).logits
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.tensor(token_ids)[:, 1:].reshape(-1), reduction="sum"
    ).backward()
    reference = {name: parameter.grad for name, parameter in hf.named_parameters()}
    rendezvous = Rendezvous("127.0.0.1", 120.0)
    results = ray.get([
        _megatron_gradients.remote(str(model_dir), rank, ep, rendezvous.address, ep, token_ids) for rank in range(ep)
    ])
    grads = results[0]
    routers = [name for name in grads if name.endswith("mlp.gate.weight")]
    experts = [name for name in grads if ".mlp.experts." in name]
    assert len(routers) == 2 and len(experts) == 2 * 8 * 3
    hf_experts = _hf_expert_grads(hf)
    for name in routers:
        assert (grads[name] - reference[name]).abs().max().item() <= 1e-5, name
    for name in experts:
        assert (grads[name] - hf_experts[name]).abs().max().item() <= 1e-5, name
    assert max(hf_experts[name].abs().max().item() for name in experts) > 1e-3  # the experts did get gradients


def _hf_expert_grads(hf) -> dict[str, torch.Tensor]:
    """HF's per-expert gradients under the checkpoint's names (transformers 5 keeps the experts fused in memory:
    gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    grads = {}
    for index, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for expert, (gate_up, down) in enumerate(zip(experts.gate_up_proj.grad, experts.down_proj.grad)):
            prefix = f"model.layers.{index}.mlp.experts.{expert}."
            gate, up = gate_up.chunk(2)
            grads.update({prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                          prefix + "down_proj.weight": down})
    return grads

