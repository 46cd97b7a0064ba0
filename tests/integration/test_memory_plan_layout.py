"""The memory plan's parameter counts against what Megatron builds: a Qwen2-MoE model (routed experts and a gated
shared expert) at TP2 x DP2 x EP2 with the distributed optimizer, four gloo ranks each building its part of the
actor's model, DDP gradient buffers and optimizer as the actor does (rlsearch.megatron). Each rank's dense and
expert parameters, gradient buffers and the optimizer's shard of them are read off the built objects and must be
the plan's, exactly: Megatron splits each routed expert's FFN over the expert-tensor-parallel ranks, as many as
the tensor-parallel ones."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from rlsearch.memory import (
    GB,
    ActorMemorySettings,
    Device,
    Layout,
    MemoryInputs,
    ModelShape,
    plan_memory,
    stage_parameters,
)
from tests.integration.rank_processes import run_rank_processes
from tests.models import make_test_model

LAYOUT = Layout(tp=2, dp=2, ep=2)
TIME_LIMIT_S = 600.0  # a hang guard: four ranks building a tiny model


def _rank_main(rank: int, rendezvous: str, out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: before anything initialises CUDA
    from rlsearch.config import ActorConfig
    from rlsearch.megatron.model import build_model_chunks, make_bridge
    from rlsearch.megatron.parallel import init_megatron_parallel
    from rlsearch.megatron.training import build_training_model

    actor = ActorConfig(tp=LAYOUT.tp, dp=LAYOUT.dp, ep=LAYOUT.ep, use_distributed_optimizer=True)
    init_megatron_parallel(rank, actor.world_size, rendezvous, tp=actor.tp, ep=actor.ep, backend="gloo")
    chunks = build_model_chunks(make_bridge(str(Path(out_dir) / "model"), torch.float32, "local", on_cpu=True))
    training = build_training_model(chunks, actor, total_steps=1)
    (model,) = training.chunks
    parameters = list(model.module.parameters())
    held = {
        # Megatron marks the expert-parallel parameters: their gradients are reduced over expert-data-parallel ranks
        "dense": sum(p.numel() for p in parameters if getattr(p, "allreduce", True)),
        "expert": sum(p.numel() for p in parameters if not getattr(p, "allreduce", True)),
        "gradient_buffers": sum(buffer.numel for buffer in model.buffers + model.expert_parallel_buffers),
        # the distributed optimizer's shard of each kind of parameter (fp32 weights: its main parameters are views)
        "optimized": [sum(p.numel() for group in part.optimizer.param_groups for p in group["params"])
                      for part in training.optimizer.chained_optimizers],
    }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(held))


def test_the_plan_counts_what_a_tp2_ep2_moe_rank_holds(tmp_path):
    model_dir = make_test_model(tmp_path / "model", architecture="qwen2_moe")
    run_rank_processes(_rank_main, LAYOUT.ranks, str(tmp_path), TIME_LIMIT_S)
    shape = ModelShape.from_model_dir(model_dir)
    parameters = stage_parameters(shape, tp=LAYOUT.tp, pp=1, ep=LAYOUT.ep, stage=0)
    settings = ActorMemorySettings(tokens=1024, layout=LAYOUT, distributed_optimizer=True)
    (rank,) = plan_memory(MemoryInputs(shape, settings, Device("cpu", 24 * GB, "host"))).ranks
    for index in range(LAYOUT.ranks):
        held = json.loads((tmp_path / f"rank{index}.json").read_text())
        dense_optimized, expert_optimized = held["optimized"]
        print(f"\nrank {index}: {held}")
        assert (parameters.dense, parameters.expert) == (held["dense"], held["expert"])
        assert rank.parameters == held["dense"] + held["expert"]
        assert rank.weights == 4 * rank.parameters  # float32
        assert rank.gradients == 4 * held["gradient_buffers"]
        # Adam's two fp32 moments of this rank's shard: dense parameters over the two data-parallel ranks, experts
        # over their one expert-data-parallel rank (dp / ep)
        assert (dense_optimized, expert_optimized) == (held["dense"] // 2, held["expert"])
        assert rank.optimizer == 8 * (dense_optimized + expert_optimized)
