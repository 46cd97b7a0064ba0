"""Activation recomputation (actor.recompute selective and full) against none: the logprobs a training step computes
and every gradient it makes, at TP2, CP2, PP2 and EP2, with prefix trees and chunked logits; the MoE layouts replay
their recorded routing (algo.routing_replay=old), so a recomputed router must route as the forward pass it repeats did,
also when the pipeline schedule has run later micro-batches' forwards in between. The TP2 layout's model sets dropout in
its config.json (attention and hidden): a recomputed forward must draw the masks the stored one drew (Megatron saves
the RNG states, the default generator's and the tensor-parallel tracker's, and restores them to recompute), so there,
each mode's step starting from the same RNG states, logprobs and gradients agree bit for bit.

Each layout starts its two ranks once; in them an actor of each mode (none, selective, full) is built in turn in the
same process group (`MegatronActorWorker.build`) from the same HF weights and takes one GRPO step on the same batch.
Call counts of the layers and modules show what ran again.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import pytest
import torch

from rlsearch.data.tiny_model import make_tiny_model
from tests.integration.actor_helpers import long_sequence_batch
from tests.integration.rank_processes import run_rank_processes
from tests.models import model_spec


@dataclass(frozen=True)
class Layout:
    model: str  # dense | moe
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    full: tuple[str, int] = ("uniform", 1)  # actor.recompute_method, actor.recompute_num_layers
    selective: tuple[str, ...] = ("core_attn",)  # actor.recompute_modules


LAYOUTS = {
    # bit for bit with dropout; recomputing the norms (the other layouts') reorders a gradient sum: ~1e-8 off
    "tp2": Layout("dropout", tp=2, full=("uniform", 2), selective=("core_attn", "mlp")),
    "cp2": Layout("dense", cp=2, full=("block", 1), selective=("core_attn", "layernorm")),
    "pp2": Layout("moe", pp=2, selective=("core_attn", "moe")),
    "ep2": Layout("moe", dp=2, ep=2, selective=("layernorm", "shared_experts")),
}
MODES = ("none", "selective", "full")
TOLERANCE = 1e-6  # float32; measured values are printed
DROPOUT = 0.1  # the dropout model's attention_dropout and hidden_dropout (config.json)
TIME_LIMIT_S = 240.0


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, module_tmp):
    # Qwen2-MoE: every layer routed, plus a gated shared expert
    moe = make_tiny_model(module_tmp.mktemp("recompute-moe") / "qwen2_moe",
                          model_spec(architecture="qwen2_moe"))
    dropout = Path(shutil.copytree(tiny_model_dir, module_tmp.mktemp("recompute-dropout") / "dense"))
    config = json.loads((dropout / "config.json").read_text())
    (dropout / "config.json").write_text(json.dumps({**config, "attention_dropout": DROPOUT,
                                                     "hidden_dropout": DROPOUT}))
    return {"dense": tiny_model_dir, "moe": moe, "dropout": dropout}


def _settings(layout: Layout, mode: str) -> dict:
    settings = {"recompute": mode}
    if mode == "full":
        settings.update(recompute_method=layout.full[0], recompute_num_layers=layout.full[1])
    if mode == "selective":
        settings["recompute_modules"] = list(layout.selective)
    return settings


def _probes(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """(name `<layer>.<what>` with the global layer number, module, the layer's index in its stage) of the modules
    whose calls are counted."""
    probes = []
    for index, layer in enumerate(chunk.module.decoder.layers):
        modules = {"layer": layer, "core_attn": layer.self_attention.core_attention,
                   "layernorm": layer.input_layernorm, "mlp": layer.mlp}
        if hasattr(layer.mlp, "router"):
            modules.update(router=layer.mlp.router, shared_experts=layer.mlp.shared_experts)
        probes += [(f"{layer.layer_number}.{what}", module, index) for what, module in modules.items()]
    return probes


def _recomputed(layout: Layout, mode: str, probe: str, stage_layer: int) -> bool:
    """Whether `mode` runs the module `probe` (`<layer>.<what>`, the layer the `stage_layer`-th of its stage) twice."""
    what = probe.split(".", 1)[1]
    if mode == "full":
        method, count = layout.full
        return method == "uniform" or stage_layer < count
    if mode == "selective":
        modules = set(layout.selective)
        if "moe" in modules:  # the whole MoE layer: the router and the shared expert in it
            modules |= {"router", "shared_experts"}
        return what in modules
    return False


def _count(counts: dict[str, int], probe: str, *_hook_args) -> None:
    counts[probe] = counts.get(probe, 0) + 1


def _rank_main(rank: int, rendezvous: str, out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: before anything initialises CUDA
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, MegatronActorWorker
    from rlsearch.algo import grpo_objective
    from rlsearch.config import ActorConfig, AlgoConfig

    case = torch.load(Path(out_dir) / "case.pt", weights_only=False)
    layout: Layout = case["layout"]
    world = layout.tp * layout.pp * layout.cp * layout.dp
    algo = AlgoConfig(routing_replay="old" if layout.model == "moe" else "none")
    results, reference = {}, {}
    worker = None
    rng_states = None  # the default generator's and the tracker's before the first mode's step
    for mode in MODES:
        actor = ActorConfig(
            tp=layout.tp, pp=layout.pp, cp=layout.cp, dp=layout.dp, ep=layout.ep, lr=1e-5,
            max_tokens_per_microbatch=200, logits_chunk_tokens=16, merge_prefixes=True, **_settings(layout, mode),
            dropout="model",  # the dropout model's config.json values (RL's default trains without them)
        )
        spec = ActorWorkerSpec(case["model_dir"], "float32", actor, algo, MODEL_DISTRIBUTION, total_steps=4, seed=1)
        first = worker is None
        worker = MegatronActorWorker(spec, rank, world)
        info = worker.initialize(rendezvous) if first else worker.build()
        samples = case["samples"]
        base, extra = divmod(len(samples), layout.dp)  # contiguous data-parallel shards, as ActorRanks makes them
        start = info.dp_rank * base + min(info.dp_rank, extra)
        shard = samples[start:start + base + (info.dp_rank < extra)]
        if algo.routing_replay == "old":
            _, routing = worker.compute_logprobs_and_routing(shard)
            # each stage recorded its own layers (-1 in the others'): merged over the pipeline
            merged = torch.cat([r.flatten() for r in routing]).long()
            dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
            rows = merged.split([r.numel() for r in routing])
            shard = [replace(s, routed_experts=row.view(r.shape)) for s, row, r in zip(shard, rows, routing)]
        counts: dict[str, int] = {}
        stage_layers: dict[str, int] = {}
        for chunk in worker.model:
            for probe, module, stage_layer in _probes(chunk):
                stage_layers[probe] = stage_layer
                module.register_forward_pre_hook(partial(_count, counts, probe))
        logprobs: list[torch.Tensor] = []

        def objective(token_logprobs, mb, kept=logprobs):
            kept.append(token_logprobs.detach().clone())
            return grpo_objective(token_logprobs, mb, algo=algo)

        # every mode's step starts from the same RNG states: with dropout the forward passes draw the same masks
        if rng_states is None:
            rng_states = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
        torch.set_rng_state(rng_states[0])
        get_cuda_rng_tracker().set_states(dict(rng_states[1]))
        metrics = worker.train_step(shard, layout.dp, objective)
        first_layer = worker.model[0].module.decoder.layers[0]
        grads = {f"{i}.{name}": p.main_grad.detach().clone() for i, chunk in enumerate(worker.model)
                 for name, p in chunk.module.named_parameters() if p.requires_grad}
        if mode == "none":
            reference = {"logprobs": logprobs, "grads": grads}
        results[mode] = {
            "counts": counts, "stage_layers": stage_layers, "grad_norm": metrics["grad_norm"],
            "logprob_diff": max(((a - b).abs().max().item() for a, b in zip(logprobs, reference["logprobs"])),
                                default=0.0),
            "logprob_count": sum(t.numel() for t in logprobs),
            "same_logprob_shapes": [t.shape for t in logprobs] == [t.shape for t in reference["logprobs"]],
            "grad_diff": {name: (g - reference["grads"][name]).abs().max().item() for name, g in grads.items()},
            "grad_total": sum(g.abs().sum().item() for g in grads.values()),
            "dropout": (first_layer.self_attention.core_attention.attention_dropout.p, first_layer.hidden_dropout),
            # the generators moved: the step drew dropout masks (attention's from the tracker's stream)
            "drew": (not torch.equal(torch.get_rng_state(), rng_states[0]),
                     any(not torch.equal(state, rng_states[1][name])
                         for name, state in get_cuda_rng_tracker().get_states().items())),
        }
        if mode != MODES[-1]:  # one mode's model at a time
            del worker.model, worker.training, worker.routers
            gc.collect()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    worker.shutdown()


@pytest.fixture(scope="module")
def run_layout(model_dirs, module_tmp):
    cache: dict[str, list[dict]] = {}
    batches: dict[str, list] = {}

    def run(name: str) -> list[dict]:
        if name not in cache:
            layout = LAYOUTS[name]
            if layout.model not in batches:
                batches[layout.model], _ = long_sequence_batch(model_dirs[layout.model])
            out_dir = module_tmp.mktemp(f"recompute-{name}")
            torch.save({"layout": layout, "model_dir": str(model_dirs[layout.model]),
                        "samples": batches[layout.model]}, out_dir / "case.pt")
            world = layout.tp * layout.pp * layout.cp * layout.dp
            run_rank_processes(_rank_main, world, str(out_dir), TIME_LIMIT_S)
            cache[name] = [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world)]
        return cache[name]

    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recompute_selective_and_full_equal_none(run_layout, name):
    layout = LAYOUTS[name]
    ranks = run_layout(name)
    assert sum(results["none"]["logprob_count"] for results in ranks) > 0
    with_dropout = layout.model == "dropout"
    tolerance = 0.0 if with_dropout else TOLERANCE  # with dropout: the same masks, the same numbers
    for rank, results in enumerate(ranks):
        none = results["none"]
        assert none["grad_total"] > 0 and none["grad_norm"] > 0
        assert none["dropout"] == ((DROPOUT, DROPOUT) if with_dropout else (0.0, 0.0))
        assert not with_dropout or none["drew"] == (True, True)
        for mode in ("selective", "full"):
            result = results[mode]
            worst_grad = max(result["grad_diff"].values())
            print(f"\n{name} rank {rank} {mode}: logprobs {result['logprob_diff']:.1e} over "
                  f"{result['logprob_count']} positions, gradients {worst_grad:.1e} over "
                  f"{len(result['grad_diff'])} tensors, grad norm {result['grad_norm']:.6f} vs {none['grad_norm']:.6f}")
            assert result["same_logprob_shapes"]
            assert result["logprob_diff"] <= tolerance
            assert worst_grad <= tolerance, max(result["grad_diff"], key=result["grad_diff"].get)
            assert result["grad_norm"] == pytest.approx(none["grad_norm"], rel=tolerance, abs=0)
            # what ran again: twice the calls of the run without recomputation, the rest as often
            assert set(result["counts"]) == set(none["counts"])
            for probe, calls in none["counts"].items():
                times = 2 if _recomputed(layout, mode, probe, result["stage_layers"][probe]) else 1
                assert result["counts"][probe] == times * calls, (mode, probe, result["counts"][probe], calls)
