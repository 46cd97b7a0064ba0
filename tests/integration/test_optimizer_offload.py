"""Optimizer offload (actor.optimizer_offload_fraction): Megatron's hybrid optimizer keeps that share of the
distributed optimizer's states (Adam's moments and the fp32 main weights) in host memory, updated by a CPU
optimizer, and copies the updated main weights back.

Two DP2 rank processes build, one after another in one process group, a plain distributed-optimizer actor and one
offloading half of its optimizer, both in bfloat16 (the hybrid optimizer takes fp32 main copies of low-precision
weights; with float32 weights the actor refuses it at start-up); both train four steps (the offloading one saving
after the second), then a fresh offloading actor loads that checkpoint and trains steps 3 and 4 again. On CPU every
state is in host memory anyway: the model's parameters stand for the GPU-resident ones
(rlsearch/megatron/cpu_compat.py), so the split, the host copies, their updates and the copy back run as on a GPU.
"""

from __future__ import annotations

import gc
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.integration.actor_helpers import hf_logprobs, scored_batch
from tests.integration.rank_processes import run_rank_processes

FRACTION = 0.5
STEPS = 4
SAVED_AFTER = 2


def _rank_main(rank: int, rendezvous: str, out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: before anything initialises CUDA
    import torch.distributed as dist

    from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, MegatronActorWorker
    from rlsearch.algo import grpo_objective
    from rlsearch.config import ActorConfig, AlgoConfig

    case = torch.load(Path(out_dir) / "case.pt", weights_only=False)
    batches = case["batches"]
    worker = None
    results = {}

    def build(fraction: float) -> None:
        nonlocal worker
        first = worker is None
        if not first:  # one actor at a time
            del worker.model, worker.training
            gc.collect()
        actor = ActorConfig(dp=2, lr=1e-4, lr_warmup_steps=3, max_tokens_per_microbatch=160,
                            use_distributed_optimizer=True, optimizer_offload_fraction=fraction)
        spec = ActorWorkerSpec(case["model_dir"], "bfloat16", actor, AlgoConfig(), MODEL_DISTRIBUTION, total_steps=4,
                               seed=1)
        worker = MegatronActorWorker(spec, rank, 2)
        if first:
            worker.initialize(rendezvous)
        else:
            worker.build()

    def train(steps, checkpoint: Path | None = None) -> dict[int, dict[str, torch.Tensor]]:
        """After each step: this rank's fp32 main weights (its distributed-optimizer shard) and the bf16 weights."""
        weights = {}
        for step in steps:
            shard = batches[step - 1][rank * 4:(rank + 1) * 4]  # 8 samples: DP rank r holds 4r..4r+3
            worker.train_step(shard, 2, lambda logprobs, mb: grpo_objective(logprobs, mb, algo=AlgoConfig()))
            (optimizer,) = worker.training.optimizer.chained_optimizers  # a dense model: one distributed optimizer
            main = optimizer.shard_fp32_from_float16_groups
            weights[step] = {"main": torch.cat([p.detach().flatten().clone() for group in main for p in group]),
                             "model": worker.hf_state_dict()}  # bf16 weights on rank 0 (None on rank 1)
            if step == SAVED_AFTER and checkpoint is not None:
                checkpoint.mkdir(exist_ok=True)  # by either rank
                worker.save_checkpoint(str(checkpoint))
        return weights

    checkpoint = Path(out_dir) / "checkpoint"
    build(0.0)
    results["plain"] = train(range(1, STEPS + 1))
    build(FRACTION)
    results["offloaded"] = train(range(1, STEPS + 1), checkpoint)
    hybrid = worker.training.optimizer.chained_optimizers[0].optimizer  # the distributed optimizer's inner one
    parameters = [p for group in hybrid.param_groups for p in group["params"]]
    on_host = sum(p.numel() for optimizer in hybrid.cpu_optimizers for g in optimizer.param_groups
                  for p in g["params"])
    total = sum(p.numel() for p in parameters)
    results["split"] = {
        "kind": type(hybrid).__name__, "host_share": on_host / total,
        "largest_share": max(p.numel() for p in parameters) / total,
        "host_states": sum(len(optimizer.state) for optimizer in hybrid.cpu_optimizers),
        "device_states": len(hybrid.gpu_optimizer.state) if hybrid.gpu_optimizer else 0,
    }
    build(FRACTION)
    loaded_step = worker.load_checkpoint(str(checkpoint), restore_rng=True)
    results["resumed"] = {"loaded_step": loaded_step, **train(range(SAVED_AFTER + 1, STEPS + 1))}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    worker.shutdown()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, module_tmp) -> list[dict]:
    samples, _ = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    flipped = [replace(sample, advantage=-sample.advantage) for sample in samples]
    out_dir = module_tmp.mktemp("optimizer-offload")
    torch.save({"model_dir": str(tiny_model_dir), "batches": [samples, flipped] * (STEPS // 2)}, out_dir / "case.pt")
    run_rank_processes(_rank_main, 2, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


def test_optimizer_offload_trains_as_the_distributed_optimizer(runs):
    for rank, result in enumerate(runs):
        plain, offloaded = result["plain"], result["offloaded"]
        for step in range(1, STEPS + 1):
            worst = (offloaded[step]["main"] - plain[step]["main"]).abs().max().item()
            moved = (plain[step]["main"] - plain[step - 1]["main"]).abs().max().item() if step > 1 else float("nan")
            print(f"\nrank {rank} step {step}: fp32 main weights offloaded vs plain {worst:.1e} (the step moved them "
                  f"up to {moved:.1e})")
            assert worst < 1e-6
        assert (plain[2]["main"] - plain[1]["main"]).abs().max().item() > 1e-5
        split = result["split"]
        print(f"rank {rank}: {split}")
        assert split["kind"] == "HybridDeviceOptimizer"
        # the first parameters up to half of the elements: at most one parameter more than half
        assert FRACTION <= split["host_share"] < FRACTION + split["largest_share"]
        assert split["host_states"] > 0 and split["device_states"] > 0  # both optimizers stepped
    plain, offloaded = runs[0]["plain"], runs[0]["offloaded"]  # rank 0 holds the bf16 export
    for step in range(1, STEPS + 1):
        worst = _max_diff(offloaded[step]["model"], plain[step]["model"])
        print(f"step {step}: bf16 weights offloaded vs plain {worst:.1e}")
        assert worst < 1e-6


def test_optimizer_offload_checkpoint_resumes_exactly(runs):
    for result in runs:
        offloaded, resumed = result["offloaded"], result["resumed"]
        assert resumed["loaded_step"] == SAVED_AFTER
        for step in range(SAVED_AFTER + 1, STEPS + 1):
            assert (resumed[step]["main"] - offloaded[step]["main"]).abs().max().item() < 1e-6, step
    offloaded, resumed = runs[0]["offloaded"], runs[0]["resumed"]
    for step in range(SAVED_AFTER + 1, STEPS + 1):
        assert _max_diff(resumed[step]["model"], offloaded[step]["model"]) == 0.0, step
