"""Loading the distributed optimizer's states from a checkpoint (rlsearch/megatron/training.py): every state torch's
Adam holds per parameter comes back bit for bit (the parameter, both moments; `step` from the parameter groups), and
a state the checkpoint has no tensor for, or a tensor no state takes, is refused naming it instead of being left as
it was (the zeros of a fresh optimizer) or dropped.

Two DP2 rank processes: an actor with the distributed optimizer trains a step and saves a checkpoint, a fresh one
loads it; then the load's per-parameter copy is handed what a checkpoint would hold without one of its tensors, and
with one more."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from tests.integration.actor_helpers import hf_logprobs, scored_batch
from tests.integration.rank_processes import run_rank_processes

TIME_LIMIT_S = 600.0  # a hang guard: two builds and a step of the tiny model


def _rank_main(rank: int, rendezvous: str, out_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks: before anything initialises CUDA
    import torch.distributed as dist

    from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, MegatronActorWorker
    from rlsearch.algo import grpo_objective
    from rlsearch.config import ActorConfig, AlgoConfig

    case = torch.load(Path(out_dir) / "case.pt", weights_only=False)
    actor = ActorConfig(dp=2, lr=1e-4, max_tokens_per_microbatch=160, use_distributed_optimizer=True)
    spec = ActorWorkerSpec(case["model_dir"], "float32", actor, AlgoConfig(), MODEL_DISTRIBUTION, total_steps=4, seed=1)
    saver = MegatronActorWorker(spec, rank, 2)
    saver.initialize(rendezvous)
    shard = case["samples"][rank * 4:(rank + 1) * 4]  # 8 samples: DP rank r holds 4r..4r+3
    saver.train_step(shard, 2, lambda logprobs, mb: grpo_objective(logprobs, mb, algo=AlgoConfig()))
    checkpoint = Path(out_dir) / "checkpoint"
    checkpoint.mkdir(exist_ok=True)  # by either rank
    saver.save_checkpoint(str(checkpoint))
    results = {"saved": _states(saver)}
    del saver.model, saver.training
    gc.collect()

    loader = MegatronActorWorker(spec, rank, 2)
    loader.build()
    loader.load_checkpoint(str(checkpoint), restore_rng=False)
    results["loaded"] = _states(loader)
    (optimizer,) = loader.training.optimizer.chained_optimizers  # a dense model: one distributed optimizer
    model_param = next(iter(optimizer.model_param_group_index_map))
    held = {key: tensor.clone() for key, tensor in optimizer._get_main_param_and_optimizer_states(model_param).items()
            if key != "step"}  # what the checkpoint holds of this parameter: param, exp_avg, exp_avg_sq
    refusals = {}
    for case_name, tensors in (("without exp_avg_sq", {k: v for k, v in held.items() if k != "exp_avg_sq"}),
                               ("with max_exp_avg_sq", {**held, "max_exp_avg_sq": held["exp_avg_sq"]})):
        try:
            with torch.no_grad():  # as the load runs it
                optimizer._set_main_param_and_optimizer_states(model_param, tensors)
            refusals[case_name] = None
        except RuntimeError as error:
            refusals[case_name] = str(error)
    results["refusals"] = refusals
    results["refused_param"] = optimizer._param_name(model_param)
    results["after_refusals"] = _states(loader)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    loader.shutdown()


def _states(worker) -> dict[str, torch.Tensor]:
    """Every state this rank's distributed optimizer holds per main parameter (its shard), by parameter and key."""
    (optimizer,) = worker.training.optimizer.chained_optimizers
    adam = optimizer.optimizer
    return {f"{index}.{key}": tensor.detach().clone()
            for index, param in enumerate(p for group in adam.param_groups for p in group["params"])
            for key, tensor in {"param": param, **adam.state.get(param, {})}.items()}


def test_a_loaded_optimizer_state_is_copied_whole_and_a_state_the_checkpoint_lacks_is_refused(tiny_model_dir,
                                                                                               tmp_path):
    samples, _ = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    torch.save({"model_dir": str(tiny_model_dir), "samples": samples}, tmp_path / "case.pt")
    run_rank_processes(_rank_main, 2, str(tmp_path), TIME_LIMIT_S)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        saved, loaded = results["saved"], results["loaded"]
        keys = {name.split(".", 1)[1] for name in saved}
        assert keys == {"param", "exp_avg", "exp_avg_sq", "step"}
        assert set(loaded) == set(saved)
        for moment in ("exp_avg", "exp_avg_sq", "step"):  # a fresh optimizer's are zeros, the trained one's not
            assert any(tensor.any() for name, tensor in saved.items() if name.endswith(f".{moment}"))
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), name
        refusals = results["refusals"]
        assert refusals["without exp_avg_sq"] is not None, "a checkpoint without exp_avg_sq loaded"
        assert "the checkpoint has no 'exp_avg_sq' tensor" in refusals["without exp_avg_sq"]
        assert refusals["with max_exp_avg_sq"] is not None, "a checkpoint tensor no state takes was dropped"
        assert "the checkpoint's 'max_exp_avg_sq' tensor is no state of this optimizer" in refusals[
            "with max_exp_avg_sq"]
        assert all(results["refused_param"] in refusal for refusal in refusals.values())
        for name, tensor in saved.items():  # nothing was copied by a refused load
            assert torch.equal(results["after_refusals"][name], tensor), name
