"""The Megatron actor on one GPU without Ray: logprob parity with HF, GRPO steps, timing, a profile.

See docs/benchmarks.md#gpu_actor_check."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from rlsearch.algo import grpo_objective  # noqa: E402


def grpo_step(worker, samples) -> dict[str, float]:
    """One GRPO optimizer step of a single-rank worker (no data parallelism)."""
    return worker.train_step(samples, 1, partial(grpo_objective, algo=worker.spec.algo))


def start_single_rank_worker(model_path: Path, dtype: str, actor, algo, total_steps: int):
    """A `MegatronActorWorker` at world size 1 in this process (its own rendezvous, no Ray), initialised."""
    import torch.distributed as dist

    from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, MegatronActorWorker

    os.environ.setdefault("RLSEARCH_NODE_IP", "127.0.0.1")  # the worker opens its group's store here, without Ray
    spec = ActorWorkerSpec(str(model_path), dtype, actor, algo, MODEL_DISTRIBUTION, max(total_steps, 1), 0)
    worker = MegatronActorWorker(spec, rank=0, world_size=1)
    started = time.perf_counter()
    info = worker.initialize(worker.open_rendezvous("actor", 60.0))
    print(f"megatron: backend {dist.get_backend()}, layer spec {info.transformer_impl}, initialised in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return worker


def hf_logprobs(model, samples, temperature: float) -> list[torch.Tensor]:
    """Response logprobs of each sample run alone through an HF causal LM (float64 on the host)."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.token_ids, device=device).unsqueeze(0)
            logits = model(input_ids=ids).logits[0, s.response_start - 1 : -1].float() / temperature
            labels = ids[0, s.response_start :]
            out.append(torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0].double().cpu())
    return out


def max_abs_diff(ours: list[list[float]], theirs: list[torch.Tensor]) -> float:
    return max(float((torch.tensor(a, dtype=torch.float64) - b).abs().max()) for a, b in zip(ours, theirs))


def profile(worker, samples, steps: int, on_gpu: bool) -> None:
    """Per-phase wall time of `steps` train steps (synchronised at the phase boundaries), then the top ops of one
    more step by self device (or CPU) time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    totals = {"forward+backward": 0.0, "optimizer": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            totals[name] += time.perf_counter() - t0
            return out
        return wrapper

    # instance attributes shadow the methods for these steps only
    worker._run_pipeline = timed("forward+backward", worker._run_pipeline)
    worker.training.optimizer.step = timed("optimizer", worker.training.optimizer.step)
    try:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            grpo_step(worker, samples)
        sync()
        wall = time.perf_counter() - t0
    finally:
        del worker._run_pipeline, worker.training.optimizer.step
    other = wall - sum(totals.values())
    print(f"profile: {wall / steps * 1e3:.1f} ms/step = " + ", ".join(
        f"{name} {seconds / steps * 1e3:.1f} ms ({seconds / wall:.0%})" for name, seconds in totals.items())
        + f", other {other / steps * 1e3:.1f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch_profile(activities=activities) as prof:
        grpo_step(worker, samples)
        sync()
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60), flush=True)
    if on_gpu:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60),
              flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=150)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=2048)
    parser.add_argument("--kl-coef", type=float, default=0.01, help="> 0 also checks the reference model")
    parser.add_argument("--tol", type=float, default=1e-4, help="max |logprob diff| allowed in float32")
    parser.add_argument("--train-steps", type=int, default=2)
    parser.add_argument("--time-steps", type=int, default=0, help="timed train steps per side (0: no timing)")
    parser.add_argument("--profile-steps", type=int, default=0, help="phase-timed train steps (0: no profile)")
    parser.add_argument("--hf-micro-batch", type=int, default=4)
    parser.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    add_vocab_ranks_argument(parser)
    return parser


def timing(args: argparse.Namespace, worker, samples, model_path: Path, tokens: int, on_gpu: bool) -> None:
    """HF's train step against the worker's on the same batch, alternated: tokens/s of each."""
    from bench.common.memory import memory_mib
    from bench.train_step import HFTrainer

    if args.time_steps:
        trainer = HFTrainer(str(model_path), args.dtype, torch.get_num_threads(), args.hf_micro_batch, "trl")
        sides = {"hf": lambda: trainer.train_step(samples), "megatron": lambda: grpo_step(worker, samples)}
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        order = ["hf", "megatron"]
        for step in range(args.time_steps + 1):
            for name in order:
                if on_gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                sides[name]()
                if on_gpu:
                    torch.cuda.synchronize()
                if step:
                    seconds[name].append(time.perf_counter() - t0)
            order.reverse()
        rates = {name: tokens * len(times) / sum(times) for name, times in seconds.items()}
        for name, rate in rates.items():
            print(f"timing {name:8s}: {rate:8.0f} tokens/s over {args.time_steps} steps "
                  f"(mean {sum(seconds[name]) / args.time_steps * 1e3:.1f} ms/step)", flush=True)
        print(f"timing megatron / hf tokens/s ({args.dtype}, same process, no Ray): "
              f"{rates['megatron'] / rates['hf']:.2f}x; both sides' memory now {memory_mib()[0]:.0f} MiB, peak "
              f"{memory_mib()[1]:.0f} MiB", flush=True)


def train(args: argparse.Namespace, worker, samples, ours: list[list[float]]) -> list[str]:
    """--train-steps GRPO steps, each finite, and the policy moved by them; what failed."""
    failures = []
    for step in range(args.train_steps):
        t0 = time.perf_counter()
        stats = grpo_step(worker, samples)
        elapsed = time.perf_counter() - t0
        print(f"train step {step + 1}: {elapsed:.2f} s, policy loss {stats['policy_loss']:+.5f}, kl loss "
              f"{stats['kl_loss']:.3e}, grad norm {stats['grad_norm']:.4f}, update_ok {stats['update_ok']:.0f}, "
              f"clipped tokens {stats['clip_tokens']:.0f}/{stats['tokens']:.0f}", flush=True)
        if not (math.isfinite(stats["policy_loss"]) and math.isfinite(stats["grad_norm"]) and stats["update_ok"]):
            failures.append(f"train step {step + 1}: {stats}")
    if args.train_steps:
        after = worker.compute_logprobs(samples)
        moved = max_abs_diff(after, [torch.tensor(r, dtype=torch.float64) for r in ours])
        print(f"after training   : max |logprob change| {moved:.3e}", flush=True)
        if not moved > 0:
            failures.append("train steps left the policy's logprobs unchanged")
    return failures


def parity(args: argparse.Namespace, worker, samples, model_path: Path, on_gpu: bool) -> tuple[list, list[str]]:
    """The worker's logprobs (policy, and reference with --kl-coef) against HF's: (the policy's, what failed)."""
    from transformers import AutoModelForCausalLM

    failures = []
    response = sum(s.response_len for s in samples)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to("cuda" if on_gpu else "cpu").eval()
    reference = hf_logprobs(hf, samples, 1.0)
    del hf
    ours = worker.compute_logprobs(samples)
    diff = max_abs_diff(ours, reference)
    print(f"parity policy    : max |logprob diff| vs HF {diff:.3e} over {response} response tokens "
          f"(mean |logprob| {float(torch.cat(reference).abs().mean()):.3f})", flush=True)
    checked = args.dtype == "float32"
    if checked and not diff <= args.tol:
        failures.append(f"policy logprob diff {diff:.3e} > {args.tol:g}")
    if args.kl_coef > 0:
        ref = worker.compute_logprobs(samples, reference=True)
        ref_diff = max_abs_diff(ref, reference)
        print(f"parity reference : max |logprob diff| vs HF {ref_diff:.3e}", flush=True)
        if checked and not ref_diff <= args.tol:
            failures.append(f"reference logprob diff {ref_diff:.3e} > {args.tol:g}")
        for sample, row in zip(samples, ref):
            sample.ref_logprobs = row
    return ours, failures


def main() -> None:
    args = parse_args(_parser(), dict(shape="tiny", sequences=4, min_len=40, max_len=80, train_steps=1, time_steps=1,
                                   profile_steps=1, vocab_ranks=SMOKE_VOCAB_RANKS))

    from bench.train_step import make_samples
    from rlsearch.config import ActorConfig, AlgoConfig

    on_gpu = torch.cuda.is_available()
    model_path = build_model(args.shape, Path(args.out), max_positions=args.max_len, vocab_ranks=args.vocab_ranks)
    samples = make_samples(args.sequences, args.min_len, args.max_len, seed=0, vocab_ranks=args.vocab_ranks)
    tokens = sum(len(s.token_ids) for s in samples)
    response = sum(s.response_len for s in samples)
    print(f"device: {torch.cuda.get_device_name(0) if on_gpu else 'cpu'}; torch {torch.__version__}; "
          f"float32 matmul precision {torch.get_float32_matmul_precision()}", flush=True)
    print(f"model: random Qwen2 '{args.shape}' {SHAPES[args.shape]}, {args.dtype}; batch: {len(samples)} sequences, "
          f"{tokens} tokens ({response} response)", flush=True)

    actor = ActorConfig(max_tokens_per_microbatch=args.max_tokens_per_microbatch)
    algo = AlgoConfig(kl_coef=args.kl_coef)
    total_steps = args.train_steps + (args.time_steps + 1 if args.time_steps else 0) + args.profile_steps + 1
    worker = start_single_rank_worker(model_path, args.dtype, actor, algo, total_steps)
    from rlsearch.actor.batch import pack_indices

    num_packed = len(pack_indices([len(s.token_ids) for s in samples], args.max_tokens_per_microbatch))
    print(f"{num_packed} packed thd micro-batches; float32 matmul precision now "
          f"{torch.get_float32_matmul_precision()}", flush=True)
    ours, failures = parity(args, worker, samples, model_path, on_gpu)
    failures += train(args, worker, samples, ours)
    timing(args, worker, samples, model_path, tokens, on_gpu)
    if args.profile_steps:
        profile(worker, samples, args.profile_steps, on_gpu)

    worker.shutdown()
    print("FAIL: " + "; ".join(failures) if failures else "PASS", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
