"""One GRPO step's memory per recomputation / offloading configuration, beside the memory plan's prediction; with
--critic also one PPO step's (algo.advantage=gae) on its actor rank and its critic rank.

See docs/benchmarks.md#memory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model  # noqa: E402
from bench.common.memory import PeakMeter, proc_status  # noqa: E402
from rlsearch.config.schema import LoRAConfig  # noqa: E402
from rlsearch.devices import cpu_cores  # noqa: E402

GB = 1e9
# configuration -> actor keys (issue 46's names)
FULL = {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
CONFIGURATIONS = {
    "none": {},
    "selective": {"recompute": "selective", "recompute_modules": ["core_attn"]},
    "full": FULL,
    "full + optimizer offload": {**FULL, "use_distributed_optimizer": True, "optimizer_offload_fraction": 1.0},
    "activation offload": {"activation_offload": "fine_grained"},
    # actor.lora: the base frozen, rank-16 adapters on every linear layer, or on the attention's only (the MLP's
    # frozen linear layers keep no input)
    "lora": {"lora": LoRAConfig(rank=16, alpha=32.0)},
    "lora attention": {"lora": LoRAConfig(rank=16, alpha=32.0, targets=["qkv", "proj"])},
}
# PPO with a learned critic (--critic): one PPO step's work of each of its ranks, the actor's keys none's, each rank
# in a process of its own as in a run; the critic's row first (its values are the actor's GAE's). name -> its side
PPO = {"ppo: critic rank": "critic", "ppo: actor rank": "actor"}
WARMUP_TOKENS = 64
RESULT = "RESULT "  # a child's result line
# the shapes --fit measures: each changes one width of the tiny shape (hidden, heads, kv heads, head size, FFN)
FIT_SHAPES = ("tiny", "fit-heads", "fit-kv", "fit-head-dim", "fit-ffn", "moe-tiny")
FIT_TOKENS = 1024


# ---- measurement, in the child process ------------------------------------------------------------------------------

def _not_applied(configuration: dict, worker) -> str:
    """What of `configuration` Megatron's config of the built worker does not say (empty when it says all): a row
    measured without it would be mislabelled."""
    config = worker.model[0].config
    recompute = configuration.get("recompute", "none")
    if recompute != "none" and config.recompute_granularity != recompute:
        return f"actor.recompute={recompute} is not in Megatron's config (recompute_granularity " \
               f"{config.recompute_granularity})"
    offload = configuration.get("activation_offload", "none")
    applied = {"layer": getattr(config, "cpu_offloading", False),
               "fine_grained": getattr(config, "fine_grained_activation_offloading", False)}
    if offload != "none" and not applied[offload]:
        return f"actor.activation_offload={offload} is not in Megatron's config"
    if "lora" in configuration:
        from rlsearch.megatron.lora import adapted_layers

        adapted = len(list(adapted_layers(worker.model)))
        expected = len(configuration["lora"].targets) * config.num_layers
        if adapted != expected:
            return f"actor.lora: {adapted} adapted layers, not {expected}"
    if configuration.get("optimizer_offload_fraction"):
        optimizer = worker.training.optimizer
        configs = [getattr(inner, "config", None) for inner in getattr(optimizer, "chained_optimizers", [optimizer])]
        if not any(getattr(inner, "optimizer_cpu_offload", False) for inner in configs):
            return "actor.optimizer_offload_fraction is not in Megatron's optimizer config"
    return ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def run_child(job: dict) -> None:
    """Every configuration of `job` in turn in this process (one, except in smoke mode): a result line each."""
    from megatron.core import parallel_state as ps

    from bench.long_sequences import single_trajectory, warmup_sample
    from rlsearch.config import ActorConfig, check_actor_devices

    torch.set_num_threads(job["threads"])
    on_gpu = torch.cuda.is_available()
    if any(name in PPO for name in job["configurations"]):
        # what PPO's work imports (Ray's package, no instance), before the idle baseline as the GRPO rows' imports
        import rlsearch.actor.critic  # noqa: F401
        import rlsearch.trainer.update  # noqa: F401
    for name in job["configurations"]:
        configuration = CONFIGURATIONS.get(name, {})
        # the idle process: imports done, nothing built (after an earlier configuration of a smoke run: its memory
        # handed back to the system first)
        baseline = 0 if on_gpu else _idle_rss()
        result = {"configuration": name, "baseline": baseline}
        worker = None
        try:
            actor = ActorConfig(max_tokens_per_microbatch=job["tokens"] + 8, logits_chunk_tokens=job["chunk"],
                                num_threads=job["threads"], **configuration)
            check_actor_devices(actor, on_gpu, job["dtype"])  # what `rlsearch train` refuses at start-up
            worker, step = _start(name, actor, job)
            result["refused"] = _not_applied(configuration, worker)
            if not result["refused"]:
                step(warmup_sample(0, job["vocab_ranks"]))
                samples = single_trajectory(job["tokens"], 0, job["vocab_ranks"])
                meter = PeakMeter(on_gpu)
                meter.start()
                started = time.perf_counter()
                grad_norm = step(samples)
                if on_gpu:
                    torch.cuda.synchronize()
                result["seconds"] = time.perf_counter() - started
                result["peak"] = meter.stop() - baseline
                result["grad_norm"] = grad_norm
        except Exception as error:  # a refusal at start-up (ours or Megatron's) or a failed step: in the table
            result["refused"] = _first_line(error)
        finally:
            if worker is not None:
                worker.shutdown()
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            if torch.distributed.is_initialized():  # a worker that failed to start after joining its group
                torch.distributed.destroy_process_group()
            del worker
        print(RESULT + json.dumps(result), flush=True)


def _start(name: str, actor, job: dict):
    """The single-rank worker of configuration `name` (a critic's for PPO's critic rank), and its step's work on a
    batch of samples, which returns the step's grad norm."""
    from functools import partial

    from bench.gpu_actor_check import start_single_rank_worker
    from rlsearch.algo import grpo_objective
    from rlsearch.config import AlgoConfig, CriticConfig

    side = PPO.get(name)
    if side is None:
        worker = start_single_rank_worker(Path(job["model"]), job["dtype"], actor, AlgoConfig(), 4)
        objective = partial(grpo_objective, algo=worker.spec.algo)
        return worker, lambda samples: worker.train_step(samples, dp_size=1, objective=objective)["grad_norm"]
    algo, critic = AlgoConfig(advantage="gae"), CriticConfig()
    if side == "actor":
        worker = start_single_rank_worker(Path(job["model"]), job["dtype"], actor, algo, 4)
    else:
        worker = _start_critic(Path(job["model"]), job["dtype"], critic.ranks_config(actor), algo)
    return worker, PPOSide(side, worker, algo, critic, Path(job["values"]))


def _start_critic(model_path: Path, dtype: str, actor, algo):
    """A critic's `MegatronActorWorker` (the policy's transformer, a value head for its output layer) at world size 1
    in this process, as bench/gpu_actor_check.py starts the actor's."""
    from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, MegatronActorWorker

    os.environ.setdefault("RLSEARCH_NODE_IP", "127.0.0.1")
    spec = ActorWorkerSpec(str(model_path), dtype, actor, algo, MODEL_DISTRIBUTION, 4, 0, value_model=True)
    worker = MegatronActorWorker(spec, rank=0, world_size=1)
    worker.initialize(worker.open_rendezvous("actor", 60.0))
    return worker


def _in_process_ranks(worker):
    """`worker`, one rank in this process, behind the ranks' methods the trainer's updates call (no Ray instance:
    CriticRanks is an ActorRanks, whose calls on its ranks all go through `_on_every_rank`)."""
    from rlsearch.actor import CriticRanks

    class InProcessRanks(CriticRanks):
        def __init__(self) -> None:  # the state of ActorRanks that those methods read
            self.spec, self.workers, self.infos = worker.spec, [worker], [worker.info]
            self.world_size = self.dp_size = 1
            self.last_tokens_per_expert = None

        def _on_every_rank(self, method: str, samples, *args, **kwargs) -> list:
            return [getattr(worker, method)(list(samples), *args, **kwargs)]

    return InProcessRanks()


class PPOSide:
    """One PPO step's work of one of its ranks on a batch of samples, as GRPOTrainer.grpo_step runs it: the critic
    rank's values, GAE (`token_estimates`) and `critic_update`; the actor rank's GAE from those values and
    `policy_update`. The critic's process hands its values over in `values_path`, every call's in order (the
    warm-up's, then the step's), and the actor's process, started after it, takes them in that order."""

    def __init__(self, side: str, worker, algo, critic, values_path: Path) -> None:
        self.side, self.algo, self.critic, self.values_path = side, algo, critic, values_path
        self.ranks = _in_process_ranks(worker)
        self.values = [] if side == "critic" else json.loads(values_path.read_text())

    def __call__(self, samples: list) -> float:
        from rlsearch.trainer.estimates import token_estimates
        from rlsearch.trainer.update import critic_update, policy_update
        from rlsearch.trajectory import Trajectory

        trajectories = [Trajectory("bench", 0, 0, s.token_ids[:s.response_start], loss_mask=list(s.loss_mask),
                                   response_ids=s.token_ids[s.response_start:], reward=1.0) for s in samples]
        if self.side == "critic":
            values = self.ranks.compute_values(samples)
            self.values.append(values)
            self.values_path.write_text(json.dumps(self.values))
        else:
            values = self.values.pop(0)
        token_estimates(trajectories, samples, self.algo, values)
        if self.side == "critic":
            return critic_update(self.ranks, samples, self.algo, self.critic)["critic/grad_norm"]
        return policy_update(self.ranks, samples, self.algo).metrics["actor/grad_norm"]


def _idle_rss() -> int:
    """This process's resident set once freed memory is handed back to the system (glibc keeps it otherwise)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    return proc_status()["VmRSS"]


# ---- the saved-tensor accounting (--fit), in the child process -----------------------------------------------------

# module name (its last parts) -> the part of rlsearch.memory's layer model it belongs to
_PARTS = {
    "input_layernorm": "norms", "pre_mlp_layernorm": "norms", "q_layernorm": "norms", "k_layernorm": "norms",
    "linear_qkv": "linear_inputs", "linear_proj": "linear_inputs", "linear_fc1": "linear_inputs",
    "linear_fc2": "linear_inputs", "core_attention": "core_attn", "mlp": "mlp", "experts": "mlp",
    "shared_experts": "mlp", "router": "mlp", "token_dispatcher": "dispatch",
}


def _part_of(module_name: str) -> str:
    for piece in reversed(module_name.split(".")):
        if piece in _PARTS:
            return _PARTS[piece]
    return "layer_other" if ".layers." in f".{module_name}." else "outside"


def run_fit_child(job: dict) -> None:
    """Bytes per token that each part of the model saves in the forward pass of one training step for its backward
    pass (what a checkpoint recomputes inside the backward pass is not kept, so not counted): a result line."""
    from functools import partial

    from bench.gpu_actor_check import start_single_rank_worker
    from bench.long_sequences import single_trajectory, warmup_sample
    from rlsearch.algo import grpo_objective
    from rlsearch.config import ActorConfig, AlgoConfig

    torch.set_num_threads(job["threads"])
    actor = ActorConfig(max_tokens_per_microbatch=job["tokens"] + 8, logits_chunk_tokens=job["chunk"],
                        num_threads=job["threads"])
    worker = start_single_rank_worker(Path(job["model"]), job["dtype"], actor, AlgoConfig(), 4)
    step = partial(worker.train_step, dp_size=1, objective=partial(grpo_objective, algo=worker.spec.algo))
    step(warmup_sample(0, job["vocab_ranks"]))
    parameters = {p.untyped_storage().data_ptr() for chunk in worker.model for p in chunk.parameters()}
    stack: list[str] = []
    saved: dict[str, int] = {}
    seen: set[int] = set()
    def enter(part: str) -> None:
        stack.append(part)

    def leave() -> None:  # a forward hook that returned something would replace the module's output
        stack.pop()

    for chunk in worker.model:
        for name, module in chunk.named_modules():
            part = _part_of(name)
            module.register_forward_pre_hook(lambda _m, _a, part=part: enter(part))
            module.register_forward_hook(lambda _m, _a, _o: leave())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside the backward pass: not kept
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in parameters:
            seen.add(storage.data_ptr())
            part = stack[-1] if stack else "outside"
            saved[part] = saved.get(part, 0) + storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(single_trajectory(job["tokens"], 0, job["vocab_ranks"]))
    worker.shutdown()
    print(RESULT + json.dumps({"saved": saved}), flush=True)


# ---- the driver --------------------------------------------------------------------------------------------------

def _child(flag: str, job: dict, timeout: float) -> list[dict]:
    """Run one child process; its result lines (a failure of the process itself is one refused result)."""
    started = time.perf_counter()
    process = subprocess.run([sys.executable, __file__, flag, json.dumps(job)], capture_output=True, text=True,
                             timeout=timeout)
    results = [json.loads(line[len(RESULT):]) for line in process.stdout.splitlines() if line.startswith(RESULT)]
    if process.returncode and not results:
        tail = (process.stderr.strip().splitlines() or ["(no output)"])[-1]
        results = [{"configuration": name, "refused": f"the process failed ({process.returncode}): {tail[:160]}"}
                   for name in job.get("configurations", ["fit"])]
    for result in results:
        result.setdefault("wall", time.perf_counter() - started)
    return results


def _plan(model_path: Path, tokens: int, dtype: str, chunk: int, name: str, on_gpu: bool):
    """The memory plan of a single rank training one trajectory of `tokens` in configuration `name` (a PPO row's:
    with a critic rank beside it, the critic section's defaults)."""
    from rlsearch.memory import (
        ActorMemorySettings,
        CriticMemorySettings,
        Device,
        MemoryInputs,
        ModelShape,
        plan_memory,
    )

    configuration = CONFIGURATIONS.get(name, {})

    settings = ActorMemorySettings(
        tokens=tokens, dtype=dtype, logits_chunk_tokens=chunk,
        recompute=configuration.get("recompute", "none"),
        recompute_method=configuration.get("recompute_method", "uniform"),
        recompute_num_layers=configuration.get("recompute_num_layers", 1),
        recompute_modules=tuple(configuration.get("recompute_modules", ("core_attn",))),
        activation_offload=configuration.get("activation_offload", "none"),
        optimizer_offload_fraction=configuration.get("optimizer_offload_fraction", 0.0),
        distributed_optimizer=configuration.get("use_distributed_optimizer", False),
    )
    if "lora" in configuration:
        lora = configuration["lora"]
        settings = dataclasses.replace(settings, lora_rank=lora.rank, lora_targets=tuple(lora.targets),
                                       lora_dropout=lora.dropout)
    device = Device("gpu" if on_gpu else "cpu", float("inf"), "bench")
    shape = ModelShape.from_model_dir(model_path)
    critic = CriticMemorySettings(shape) if name in PPO else None
    return plan_memory(MemoryInputs(shape, settings, device, critic=critic))


def _planned_step(plan, name: str) -> float:
    """The plan's step memory (bytes) of the rank a row measures: what bench/memory.py's peak is."""
    return plan.worst_device.critic.step if PPO.get(name) == "critic" else plan.worst_device.actor.step


def run_table(args: argparse.Namespace) -> list[dict]:
    on_gpu = torch.cuda.is_available()
    rows = []
    for shape in args.shapes:
        model = build_model(shape, Path(args.out), max(args.lengths) + WARMUP_TOKENS, args.vocab_ranks)
        for tokens in args.lengths:
            # a smoke run's GRPO rows in one process; a PPO row's rank always in its own, as in a run
            grpo = [name for name in args.configurations if name not in PPO]
            jobs = [[name] for name in args.configurations if name in PPO or not args.smoke]
            if args.smoke and grpo:
                jobs.insert(0, grpo)
            values = Path(args.out) / f"ppo-values-{shape}-{tokens}.json"  # the critic's, for the actor's GAE
            values.unlink(missing_ok=True)
            for configurations in jobs:
                job = dict(model=str(model), tokens=tokens, dtype=args.dtype, chunk=args.chunk, threads=args.threads,
                           configurations=configurations, vocab_ranks=args.vocab_ranks, values=str(values))
                for result in _child("--child", job, args.timeout):
                    plan = _plan(model, tokens, args.dtype, args.chunk, result["configuration"], on_gpu)
                    result.update(shape=shape, tokens=tokens, plan=_planned_step(plan, result["configuration"]))
                    rows.append(result)
                    print(_row(result, rows), flush=True)
            values.unlink(missing_ok=True)
            if args.critic:
                ppo = [row for row in rows if row["configuration"] in PPO and (row["shape"], row["tokens"]) == (
                    shape, tokens)]
                plan = _plan(model, tokens, args.dtype, args.chunk, next(iter(PPO)), on_gpu)
                print(_ppo_lines(ppo, plan, on_gpu), flush=True)
    return rows


def _ppo_lines(rows: list[dict], plan, on_gpu: bool) -> str:
    """PPO's rows of one shape and length against the plan, measured / plan: its actor rank's and critic rank's step
    peaks, and the device's total, both processes' peaks (on CPU with their idle RSS, against the plan's totals with
    their runtimes; on GPU CUDA's allocated, against the steps: a context is outside torch's figures)."""
    head = f"ppo {rows[0]['shape']} {rows[0]['tokens']} tokens, measured / plan:"
    refused = [f"{row['configuration']}: {row['refused']}" for row in rows if row.get("refused")]
    if refused:
        return f"{head} not measured ({'; '.join(refused)})"
    by_side = {PPO[row["configuration"]]: row for row in rows}
    device = plan.worst_device
    parts = [("actor rank", by_side["actor"]["peak"], device.actor.step),
             ("critic rank", by_side["critic"]["peak"], device.critic.step),
             ("device total", sum(row["peak"] + row["baseline"] for row in rows),
              device.actor.step + device.critic.step if on_gpu else device.total)]
    lines = [head] + [f"ppo {part:<13}{measured / GB:>8.3f} / {planned / GB:>7.3f} GB = {measured / planned:.3f}"
                      for part, measured, planned in parts]
    if not on_gpu:
        lines.append(f"(the plan's host total adds Ray's processes and the driver, which the bench does not start: "
                     f"{plan.host_total / GB:.2f} GB)")
    return "\n".join(lines)


def _row(result: dict, rows: list[dict]) -> str:
    head = f"{result['shape']:<8} {result['tokens']:>7,}  {result['configuration']:<25}"
    plan = f"{result['plan'] / GB:>8.2f}"
    if result.get("refused"):
        return f"{head} {'-':>8} {'-':>9} {plan} {'-':>6} {'-':>7}  refused: {result['refused']}"
    none = next((row for row in rows if row["shape"] == result["shape"] and row["tokens"] == result["tokens"]
                 and row["configuration"] == "none" and not row.get("refused")), None)
    versus = f"{result['seconds'] / none['seconds']:.2f}x none" if none else ""
    return (f"{head} {result['seconds']:>8.3f} {result['peak'] / GB:>9.2f} {plan} "
            f"{result['plan'] / result['peak']:>6.2f} {result['baseline'] / GB:>7.2f}  {versus}")


def table_header(on_gpu: bool) -> str:
    what = "GPU max_memory_allocated" if on_gpu else "CPU peak RSS above the idle process (idle: its RSS)"
    header = (f"{'shape':<8} {'tokens':>7}  {'configuration':<25} {'seconds':>8} {'peak GB':>9} {'plan GB':>8} "
              f"{'plan/peak':>6} {'idle GB':>7}")
    return f"peak: {what}; plan: rlsearch.memory's step memory\n{header}\n{'-' * len(header)}"


def run_fit(args: argparse.Namespace) -> None:
    """Saved bytes per token and layer by part over FIT_SHAPES, and the coefficients they give."""
    from rlsearch.memory import ModelShape

    size = {"float32": 4, "bfloat16": 2}[args.dtype]
    rows = []
    for shape_name in FIT_SHAPES:
        model = build_model(shape_name, Path(args.out), vocab_ranks=args.vocab_ranks)
        shape = ModelShape.from_model_dir(model)
        job = dict(model=str(model), tokens=FIT_TOKENS, dtype=args.dtype, chunk=args.chunk, threads=args.threads,
                   vocab_ranks=args.vocab_ranks)
        (result,) = _child("--fit-child", job, args.timeout)
        if "saved" not in result:
            print(f"{shape_name}: {result.get('refused')}", flush=True)
            continue
        tokens = FIT_TOKENS  # single_trajectory's tokens
        per_layer = {part: value / tokens / shape.layers / size for part, value in result["saved"].items()
                     if part != "outside"}
        per_layer["outside"] = result["saved"].get("outside", 0) / tokens / size
        rows.append((shape_name, shape, per_layer))
        print(f"{shape_name:<13} h{shape.hidden} heads {shape.heads}/{shape.kv_heads} dim {shape.head_dim} ffn "
              f"{shape.ffn or shape.expert_ffn}: per token and layer, in dtype units: "
              + ", ".join(f"{part} {value:.1f}" for part, value in sorted(per_layer.items())), flush=True)
    dense = [(shape, parts) for name, shape, parts in rows if not shape.experts]
    if not dense:
        return
    norms = [parts.get("norms", 0) / shape.hidden for shape, parts in dense]
    mlp = [parts.get("mlp", 0) / shape.ffn for shape, parts in dense]
    outside = [parts["outside"] / shape.hidden for shape, parts in dense]
    # core attention: least squares of core_query x heads*dim + core_kv x kv_heads*dim + core_rotary x dim
    design = torch.tensor([[s.heads * s.head_dim, s.kv_heads * s.head_dim, s.head_dim] for s, _ in dense],
                          dtype=torch.float64)
    target = torch.tensor([[parts.get("core_attn", 0)] for _, parts in dense], dtype=torch.float64)
    core = torch.linalg.lstsq(design, target).solution[:, 0].tolist()
    linear = [parts.get("linear_inputs", 0) / (2 * s.hidden + s.heads * s.head_dim + s.ffn) for s, parts in dense]
    moe = [(shape, parts) for name, shape, parts in rows if shape.experts]
    lines = [
        ("norms", f"{_spread(norms)} x hidden"),
        ("core_query", f"{core[0]:.3f} x heads x head_dim"),
        ("core_kv", f"{core[1]:.3f} x kv_heads x head_dim"),
        ("core_rotary", f"{core[2]:.3f} x head_dim"),
        ("mlp", f"{_spread(mlp)} x ffn"),
        ("outside", f"{_spread(outside)} x hidden, per token (not per layer)"),
        ("linear inputs", f"{_spread(linear)} x (2 hidden + heads x head_dim + ffn): 1 when exactly the inputs"),
    ]
    device = "GPU" if torch.cuda.is_available() else "CPU"
    print(f"\ncoefficients ({args.dtype}, {device}, {len(dense)} dense shapes; in units of the dtype's bytes):")
    for name, text in lines:
        print(f"  {name:<14}{text}")
    for shape, parts in moe:
        routed = shape.experts_per_token * shape.expert_ffn + shape.shared_expert_ffn
        dispatch = (parts.get("mlp", 0) + parts.get("dispatch", 0) - _mean(mlp) * routed) / (
            shape.experts_per_token * shape.hidden)
        print(f"  {'dispatch':<14}{dispatch:.3f} x top-k x hidden (MoE: beyond mlp x the routed FFN widths)")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _spread(values: list[float]) -> str:
    return f"{_mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="", help="bench/common shapes, comma-separated (default: tiny on CPU, "
                        "tiny,0.5b on GPU)")
    parser.add_argument("--lengths", default="", help="trajectory tokens, comma-separated (default: 8192,32768 on "
                        "CPU, 16384,65536 on GPU)")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, of: {', '.join(CONFIGURATIONS)}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="",
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--chunk", type=int, default=1024, help="actor.logits_chunk_tokens")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core, or RLSEARCH_CPU_CORES)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    parser.add_argument("--critic", action="store_true", help="also one PPO step (algo.advantage=gae, the critic "
                        "section's defaults): its actor rank's and its critic rank's peaks, each in a process of its "
                        "own, and the device's total against the plan's")
    parser.add_argument("--smoke", action="store_true", help=f"tiny shape, --vocab-ranks {SMOKE_VOCAB_RANKS}, 256 "
                        "tokens, every GRPO configuration in one process, and --critic (seconds)")
    parser.add_argument("--fit", action="store_true", help="measure the per-part activation coefficients instead")
    parser.add_argument("--out", default="outputs/bench", help="where the random models are cached")
    add_vocab_ranks_argument(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--fit-child", help=argparse.SUPPRESS)
    return parser


def _settle(parser: argparse.ArgumentParser, args: argparse.Namespace, on_gpu: bool) -> None:
    """The device's defaults of the options not given (the smoke run's over them), checked."""
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.threads = args.threads or cpu_cores()
    if args.smoke:
        args.shapes, args.lengths, args.chunk, args.vocab_ranks = "tiny", "256", 64, SMOKE_VOCAB_RANKS
        args.critic = True
    args.shapes = [s for s in (args.shapes or ("tiny,0.5b" if on_gpu else "tiny")).split(",") if s]
    args.lengths = [int(n) for n in (args.lengths or ("16384,65536" if on_gpu else "8192,32768")).split(",") if n]
    args.configurations = [c.strip() for c in args.configurations.split(",") if c.strip()]
    unknown = [c for c in args.configurations if c not in CONFIGURATIONS] + [s for s in args.shapes
                                                                             if s not in SHAPES]
    if unknown:
        parser.error(f"unknown configuration or shape: {', '.join(unknown)}")
    if args.critic:  # the critic's row first: its values are the actor's GAE's
        args.configurations += list(PPO)


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.child:
        return run_child(json.loads(args.child))
    if args.fit_child:
        return run_fit_child(json.loads(args.fit_child))
    on_gpu = torch.cuda.is_available()
    _settle(parser, args, on_gpu)
    device = torch.cuda.get_device_name(0) if on_gpu else f"CPU, {os.cpu_count()} cores"
    print(f"device: {device}; torch {torch.__version__}; {args.dtype}; logits chunk {args.chunk}; "
          f"{args.threads} thread(s)", flush=True)
    if args.fit:
        return run_fit(args)
    print(table_header(on_gpu), flush=True)
    started = time.perf_counter()
    rows = run_table(args)
    measured = [row for row in rows if not row.get("refused")]
    worst = max((abs(row["plan"] / row["peak"] - 1) for row in measured), default=None)
    print(f"\n{len(rows)} rows, {len(measured)} measured, {len(rows) - len(measured)} refused; worst |plan/peak - 1| "
          + (f"{worst:.1%}" if worst is not None else "n/a") + f"; {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
