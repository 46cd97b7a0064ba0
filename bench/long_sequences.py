"""Long trajectories in the actor: a GRPO step's memory and time with chunked logits, CP, merged segments.

See docs/benchmarks.md#long_sequences."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, count_params, parse_args  # noqa: E402
from bench.common import build_model as build_shape  # noqa: E402
from bench.common import random_tokens as vocabulary_draw  # noqa: E402
from bench.common.memory import pickle_by_value_for_ray, proc_status, reset_peak_rss  # noqa: E402
from bench.common.table import print_table  # noqa: E402
from rlsearch.actor.batch import TrainSample  # noqa: E402
from rlsearch.devices import cpu_threads_each  # noqa: E402

GB = 1e9
CHUNK_TOKENS = 1024
PROMPT_TOKENS = 64  # part 1: the prompt of each trajectory (not trained)
WARMUP_TOKENS = 64
GOAL_PEAK_GB = 8.0
GOAL_MERGED_RATIO = 1.3
ONE_COLUMNS = (("tokens", ">7"), ("configuration", "<14"), ("seconds", ">8.1f"), ("step peak GB", ">13"),
               ("+step GB", ">11"), ("lifetime GB", ">11"), ("vs unchunked", "<"))
TWO_COLUMNS = (("configuration", "<19"), ("samples", ">7"), ("token rows", ">10"), ("trained", ">8"),
               ("seconds", ">8.1f"), ("step peak GB", ">12"), ("+step GB", ">8"))
# part 1 configurations: name -> (actor.logits_chunk_tokens, actor.cp)
CONFIGS = {"unchunked": (0, 1), "chunked": (CHUNK_TOKENS, 1), "chunked + CP2": (CHUNK_TOKENS, 2)}


# ---- memory probes (run inside each rank's process through `__ray_call__`) ----------------------------------------

def _reset_peak(_worker) -> tuple[float, bool]:
    """(RSS now in bytes, whether the kernel's peak could be reset to it: else VmHWM counts from the start)."""
    rss = proc_status()["VmRSS"]
    return rss, reset_peak_rss()


def _peaks(_worker) -> tuple[float, float]:
    """(peak RSS since the reset, lifetime peak RSS) in bytes."""
    return proc_status()["VmHWM"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _available_bytes() -> float:
    """The machine's MemAvailable (this process's view: the whole host)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return float("inf")


# ---- samples ------------------------------------------------------------------------------------------------------

def _random_ids(rng: random.Random, count: int, vocab_ranks: int) -> list[int]:
    ids_below = vocabulary_draw(vocab_ranks)[0]
    return [rng.randrange(ids_below) for _ in range(count)]


def _score(samples: list[TrainSample], seed: int, vocab_ranks: int) -> list[TrainSample]:
    """Old logprobs near a random model's (-log vocab) with noise so PPO ratios vary, advantages that do not
    cancel, token_mean weights over the batch: as the trainer hands them to the actor."""
    from rlsearch.algo import loss_token_weights

    generator = torch.Generator().manual_seed(seed)
    weights = loss_token_weights([s.loss_mask for s in samples], "token_mean")
    random_logprob = vocabulary_draw(vocab_ranks)[1]
    for index, (sample, w) in enumerate(zip(samples, weights)):
        sample.old_logprobs = (random_logprob + 0.3 * torch.randn(sample.response_len, generator=generator)).tolist()
        sample.advantage = (1.0, -0.6, 0.4, -1.1, 0.8)[index % 5]
        sample.token_weights = w
    return samples


def single_trajectory(length: int, seed: int, vocab_ranks: int) -> list[TrainSample]:
    """A prompt of PROMPT_TOKENS, then a response of the rest, every response token trained."""
    ids = _random_ids(random.Random(seed), length, vocab_ranks)
    prompt = min(PROMPT_TOKENS, length // 2)
    return _score([TrainSample(ids, prompt, [1] * (length - prompt))], seed, vocab_ranks)


def rerendered_segments(count: int, prompt: int, turn: int, changed: int, seed: int,
                        vocab_ranks: int) -> list[list[int]]:
    """Token ids of each segment of a re-rendering agent: segment 0 is the prompt and a turn; segment k is segment
    k - 1 with its last `changed` tokens replaced (the previous turn rendered differently), then a new turn."""
    rng = random.Random(seed)
    segments, history = [], _random_ids(rng, prompt, vocab_ranks)
    for index in range(count):
        if index:
            history = list(segments[-1])
            new = _random_ids(rng, changed, vocab_ranks)
            if new and new[0] == history[-changed]:  # the tree must branch at the first replaced token
                new[0] = (new[0] + 1) % vocabulary_draw(vocab_ranks)[0]
            history[len(history) - changed:] = new
        segments.append(history + _random_ids(rng, turn, vocab_ranks))
    return segments


def segment_samples(segments: list[list[int]], turn: int, seed: int, vocab_ranks: int) -> list[TrainSample]:
    """Every segment as a sample of one prefix group: its new turn is its response, all of it trained."""
    samples = [TrainSample(ids, len(ids) - turn, [1] * turn, prefix_group=0) for ids in segments]
    return _score(samples, seed, vocab_ranks)


def one_segment_sample(segments: list[list[int]], prompt: int, seed: int, vocab_ranks: int) -> list[TrainSample]:
    """The final segment alone: everything after the first prompt is its response, all of it trained."""
    ids = segments[-1]
    return _score([TrainSample(ids, prompt, [1] * (len(ids) - prompt))], seed, vocab_ranks)


def warmup_sample(seed: int, vocab_ranks: int) -> list[TrainSample]:
    ids = _random_ids(random.Random(seed + 99), WARMUP_TOKENS, vocab_ranks)
    return _score([TrainSample(ids, 8, [1] * (WARMUP_TOKENS - 8))], seed, vocab_ranks)


def rows_and_positions(samples: list[TrainSample], merged: bool) -> tuple[int, int]:
    """(token rows the forward pass computes, trained positions that get logits) of a step over `samples`."""
    from rlsearch.megatron.layout import PrefixTree

    positions = sum(sum(s.loss_mask) for s in samples)
    if merged and len(samples) > 1:
        return PrefixTree([s.token_ids for s in samples]).size, positions
    return sum(len(s.token_ids) for s in samples), positions


# ---- one configuration --------------------------------------------------------------------------------------------

@dataclass
class Result:
    seconds: float | None = None
    step_peak: list[float] = field(default_factory=list)  # per rank, bytes: peak RSS during the step
    increase: list[float] = field(default_factory=list)  # per rank, bytes: that peak over the RSS before the step
    lifetime: list[float] = field(default_factory=list)  # per rank, bytes: ru_maxrss
    peak_reset: bool = True
    note: str = ""  # why there is no figure: skipped / aborted / failed
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.seconds is not None


class MemoryWatchdog:
    """Kills a configuration's ranks when the machine's available memory falls below a floor (other processes on a
    shared machine included), so a misprediction ends one configuration instead of the machine."""

    def __init__(self, floor_bytes: float) -> None:
        self.floor = floor_bytes
        self.lowest = float("inf")

    def run(self, group, call) -> tuple[object | None, str]:
        import ray

        box: dict[str, object] = {}

        def target() -> None:
            try:
                box["value"] = call()
            except BaseException as error:  # reported below
                box["error"] = error

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        killed = False
        while thread.is_alive():
            thread.join(0.25)
            available = _available_bytes()
            self.lowest = min(self.lowest, available)
            if available < self.floor and not killed:
                killed = True
                for worker in group.workers:
                    ray.kill(worker)
        thread.join()
        if killed:
            return None, f"aborted: machine below {self.floor / GB:.1f} GB available"
        if "error" in box:
            error = box["error"]
            return None, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
        return box["value"], ""


def run_configuration(spec, samples: list[TrainSample], watchdog: MemoryWatchdog, seed: int,
                      vocab_ranks: int) -> Result:
    """A fresh ActorRanks: an untimed warm-up step, then the timed step with each rank's memory; shut down after."""
    import ray

    from rlsearch.actor import ActorRanks

    result = Result()
    group = ActorRanks(spec)
    alive = True
    try:
        group.train_step(warmup_sample(seed, vocab_ranks))  # the optimizer's state exists from here on
        before = ray.get([w.__ray_call__.remote(_reset_peak) for w in group.workers])
        result.peak_reset = all(reset for _, reset in before)
        started = time.perf_counter()
        metrics, note = watchdog.run(group, lambda: group.train_step(samples))
        elapsed = time.perf_counter() - started
        if note:
            alive = False
            result.note = note
            return result
        result.seconds = elapsed
        result.metrics = metrics
        peaks = ray.get([w.__ray_call__.remote(_peaks) for w in group.workers])
        result.step_peak = [peak for peak, _ in peaks]
        result.increase = [peak - rss for (peak, _), (rss, _) in zip(peaks, before)]
        result.lifetime = [lifetime for _, lifetime in peaks]
        return result
    finally:
        group.shutdown(graceful=alive)


def make_spec(model_path: Path, chunk: int, cp: int, merge: bool, max_tokens: int, threads: int, seed: int):
    from rlsearch.actor import ActorWorkerSpec, SamplingDistribution
    from rlsearch.config import ActorConfig, AlgoConfig

    actor = ActorConfig(
        cp=cp, logits_chunk_tokens=chunk, merge_prefixes=merge, max_tokens_per_microbatch=max_tokens,
        num_threads=threads, lr=1e-5, transformer_impl="local",
    )
    return ActorWorkerSpec(str(model_path), "float32", actor, AlgoConfig(), SamplingDistribution(1.0), 4, seed)


# ---- driver -------------------------------------------------------------------------------------------------------

def tiny_model(out: Path, max_positions: int, vocab_ranks: int) -> tuple[Path, int, int]:
    """The `tiny` bench shape with rotary positions up to `max_positions` (cached): (path, vocab rows, params)."""
    path = build_shape("tiny", out, max_positions, vocab_ranks)
    config = json.loads((path / "config.json").read_text())
    return path, int(config["vocab_size"]), count_params(path)


def _gb(values: list[float]) -> str:
    return "/".join(f"{v / GB:.2f}" for v in values)


def _threads(args: argparse.Namespace, ranks: int) -> int:
    return args.threads or cpu_threads_each(ranks)


def _limit_bytes(args: argparse.Namespace) -> float:
    """What a configuration may be predicted to need: --skip-above-gb, or the memory available now less headroom."""
    if args.skip_above_gb:
        return args.skip_above_gb * GB
    return _available_bytes() - args.min_free_gb * GB - 2 * GB


def part_one(args, model_path: Path, vocab: int, base_bytes: float, watchdog) -> dict[int, dict[str, Result]]:
    per_position = 3 * vocab * 4  # float32 logits, the softmax and its gradient, per trained position
    results: dict[int, dict[str, Result]] = {}
    for size in args.sizes:
        samples = single_trajectory(size, args.seed, args.vocab_ranks)
        trained = sum(samples[0].loss_mask)
        results[size] = {}
        for name, (chunk, cp) in CONFIGS.items():
            positions = -(-trained // cp)
            predicted = base_bytes + per_position * (min(chunk, positions) if chunk else positions)
            limit = _limit_bytes(args)
            if predicted > limit:
                result = Result(note=f"skipped: needs ~{predicted / GB:.0f} GB (limit {limit / GB:.0f} GB)")
                print(f"[{size:>6} tokens] {name:<14} {result.note}", flush=True)
                results[size][name] = result
                continue
            threads = _threads(args, cp)
            print(f"[{size:>6} tokens] {name:<14} {cp} rank(s) x {threads} thread(s), predicted peak "
                  f"~{predicted / GB:.1f} GB per rank ...", flush=True)
            max_tokens = size + 2 * cp  # the trajectory, padded to a multiple of 2 x cp
            spec = make_spec(model_path, chunk, cp, True, max_tokens, threads, args.seed)
            result = run_configuration(spec, samples, watchdog, args.seed, args.vocab_ranks)
            results[size][name] = result
            if result.ok:
                print(f"[{size:>6} tokens] {name:<14} {result.seconds:7.1f} s, step peak {_gb(result.step_peak)} GB "
                      f"per rank (+{_gb(result.increase)} over the RSS before), lifetime {_gb(result.lifetime)} GB "
                      f"(entropy {result.metrics['actor/entropy']:.2f}, grad norm "
                      f"{result.metrics['actor/grad_norm']:.3f}; load average {os.getloadavg()[0]:.1f})", flush=True)
            else:
                print(f"[{size:>6} tokens] {name:<14} {result.note}", flush=True)
    return results


def part_two(args, model_path: Path, watchdog) -> dict[str, tuple[Result, int, int, int]]:
    segments = rerendered_segments(args.segments, args.prompt_tokens, args.turn_tokens, args.changed_tokens,
                                   args.seed, args.vocab_ranks)
    inputs = {
        "segment by segment": (segment_samples(segments, args.turn_tokens, args.seed, args.vocab_ranks), False),
        "merged": (segment_samples(segments, args.turn_tokens, args.seed, args.vocab_ranks), True),
        "one segment": (one_segment_sample(segments, args.prompt_tokens, args.seed, args.vocab_ranks), True),
    }
    shape = {name: rows_and_positions(samples, merged) for name, (samples, merged) in inputs.items()}
    max_tokens = max(rows for rows, _ in (shape["merged"], shape["one segment"])) + 16
    threads = _threads(args, 1)
    print(f"re-rendered trajectory: {args.segments} segments of {len(segments[0])}-{len(segments[-1])} tokens "
          f"(prompt {args.prompt_tokens}, turns of {args.turn_tokens}, last {args.changed_tokens} tokens of the "
          f"history re-rendered each turn); micro-batches of <= {max_tokens} tokens, 1 rank x {threads} thread(s)",
          flush=True)
    results = {}
    for name, (samples, merged) in inputs.items():
        rows, positions = shape[name]
        print(f"[segments] {name:<19} {len(samples)} sample(s), {rows} token rows, {positions} trained positions ...",
              flush=True)
        spec = make_spec(model_path, CHUNK_TOKENS, 1, merged, max_tokens, threads, args.seed)
        result = run_configuration(spec, samples, watchdog, args.seed, args.vocab_ranks)
        results[name] = (result, len(samples), rows, positions)
        if result.ok:
            print(f"[segments] {name:<19} {result.seconds:7.1f} s, step peak {_gb(result.step_peak)} GB "
                  f"(+{_gb(result.increase)}; load average {os.getloadavg()[0]:.1f})", flush=True)
        else:
            print(f"[segments] {name:<19} {result.note}", flush=True)
    return results


def _verdict(value: float | None, goal: float) -> str:
    return "n/a" if value is None else ("PASS" if value <= goal else "FAIL")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4096,8192,16384,32768",
                        help="part 1: trajectory lengths in tokens, comma-separated (empty: skip part 1)")
    parser.add_argument("--segments", type=int, default=16, help="part 2: segments of the trajectory (0: skip part 2)")
    parser.add_argument("--turn-tokens", type=int, default=512, help="part 2: tokens of each new (trained) turn")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="part 2: the first segment's prompt")
    parser.add_argument("--changed-tokens", type=int, default=10,
                        help="part 2: tokens at the end of the history re-rendered differently every turn")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank; 0: the cores over the ranks (2 for one rank, 1 each for CP2)")
    parser.add_argument("--skip-above-gb", type=float, default=0.0,
                        help="skip a configuration predicted to need more per rank; 0: the memory available at its "
                             "start less --min-free-gb and 2 GB of headroom")
    parser.add_argument("--min-free-gb", type=float, default=1.5,
                        help="the watchdog kills a configuration when the machine has less available than this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    add_vocab_ranks_argument(parser)
    return parser


def report_goals(one: dict, ratio_merged: float | None, total: float, watchdog: MemoryWatchdog) -> None:
    """The run's time and memory headroom, and the two goals: the 32k step peak, merged against one segment."""
    print(f"total runtime {total / 60:.1f} min; load average at the end "
          f"{' '.join(f'{load:.1f}' for load in os.getloadavg())} (1, 5, 15 min); lowest available memory during "
          f"the steps {watchdog.lowest / GB:.1f} GB")
    peak_value, peak_label = None, "no chunked figure"
    if one:
        size = 32768 if 32768 in one else max(one)
        candidates = [(name, r) for name, r in one[size].items() if name != "unchunked" and r.ok]
        fitting = [(n, r) for n, r in candidates if max(r.step_peak) <= GOAL_PEAK_GB * GB]
        if candidates:  # chunked at CP1 when it fits, else CP2 when it fits, else the lower peak
            name, best = fitting[0] if fitting else min(candidates, key=lambda c: max(c[1].step_peak))
            peak_value = max(best.step_peak) / GB
            peak_label = f"{peak_value:.2f} GB ({name} at {size} tokens; +{max(best.increase) / GB:.2f} GB in the step)"
            if size != 32768:
                peak_label += " -- not a 32k figure"
    print(f"goal: 32k step peak per rank <= {GOAL_PEAK_GB:.0f} GB (with CP2 if needed): {peak_label} "
          f"{_verdict(peak_value, GOAL_PEAK_GB)}")
    merged_label = f"{ratio_merged:.2f}x" if ratio_merged is not None else "no figure"
    print(f"goal: merged <= {GOAL_MERGED_RATIO} x one segment: {merged_label} "
          f"{_verdict(ratio_merged, GOAL_MERGED_RATIO)}")


def report_two(args: argparse.Namespace, two: dict) -> float | None:
    """Part two's table (a re-rendered trajectory: merged, segment by segment, one segment): merged / one segment."""
    ratio_merged = ratio_segments = None
    if two:
        print()
        print(f"=== a {args.segments}-segment re-rendered trajectory, one GRPO step (1 rank) ===")
        print_table(TWO_COLUMNS, ([name, count, rows, positions, *(
            (result.seconds, _gb(result.step_peak), _gb(result.increase)) if result.ok else (result.note,))]
            for name, (result, count, rows, positions) in two.items()))
        merged, segments, single = (two[name][0] for name in ("merged", "segment by segment", "one segment"))
        if merged.ok and single.ok:
            ratio_merged = merged.seconds / single.seconds
            print(f"merged / one segment: {ratio_merged:.2f}x time")
        if merged.ok and segments.ok:
            ratio_segments = segments.seconds / merged.seconds
            print(f"segment by segment / merged: {ratio_segments:.2f}x time, "
                  f"{two['segment by segment'][2] / two['merged'][2]:.2f}x token rows")

    print()
    return ratio_merged


def report_one(one: dict, params: int, vocab: int) -> None:
    """Part one's table: per trajectory length, each configuration's time and memory per rank."""
    print()
    print(f"=== one trajectory, one GRPO step (fp32, {params / 1e6:.0f}M-parameter tiny Qwen2, vocabulary {vocab}) ===")
    print("memory per rank: step peak = peak RSS during the step, +step = that over the RSS before it, "
          "lifetime = ru_maxrss (ranks separated by /)")
    rows = []
    for size, row in one.items():
        reference = row.get("unchunked")
        for name, result in row.items():
            if not result.ok:
                rows.append([size, name, result.note])
                continue
            versus = ""
            if reference is not None and reference.ok and name != "unchunked":
                versus = (f"time {result.seconds / reference.seconds:.2f}x, "
                          f"peak {max(result.step_peak) / max(reference.step_peak):.2f}x")
            rows.append([size, name, result.seconds, _gb(result.step_peak), _gb(result.increase), _gb(result.lifetime),
                         versus])
    print_table(ONE_COLUMNS, rows)
    if any(not r.peak_reset for row in one.values() for r in row.values() if r.ok):
        print("(the kernel's peak could not be reset in some rank: its step peak counts from the rank's start)")


def main() -> None:
    parser = _parser()
    args = parse_args(parser, dict(sizes="512", segments=2, turn_tokens=32, prompt_tokens=32,
                                   vocab_ranks=SMOKE_VOCAB_RANKS))
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.segments == 1:
        parser.error("--segments must be 0 (skip part 2) or at least 2")

    from rlsearch.ray_setup import init_ray

    started = time.perf_counter()
    longest = max([*args.sizes, args.prompt_tokens + args.segments * args.turn_tokens, 4096])
    max_positions = max(32768, 1 << (longest - 1).bit_length())
    model_path, vocab, params = tiny_model(Path(args.out), max_positions, args.vocab_ranks)
    shape = SHAPES["tiny"]
    # the rank's resident set before a step: weights, gradients and Adam's two moments in fp32, plus the runtime
    base_bytes = 4 * 4 * params + 0.6 * GB
    print(f"model: random Qwen2 hidden {shape['hidden_size']}, {shape['num_layers']} layers, "
          f"{shape['num_attention_heads']} heads ({shape['num_key_value_heads']} kv), vocabulary {vocab}, "
          f"{params / 1e6:.0f}M parameters, fp32 on CPU, local layer spec; {os.cpu_count()} cores, "
          f"{_available_bytes() / GB:.1f} GB available, load average {os.getloadavg()[0]:.1f}", flush=True)
    init_ray(num_cpus=2)
    pickle_by_value_for_ray()
    watchdog = MemoryWatchdog(args.min_free_gb * GB)
    one = part_one(args, model_path, vocab, base_bytes, watchdog) if args.sizes else {}
    two = part_two(args, model_path, watchdog) if args.segments else {}
    total = time.perf_counter() - started

    report_one(one, params, vocab)
    ratio_merged = report_two(args, two)
    report_goals(one, ratio_merged, total, watchdog)


if __name__ == "__main__":
    main()
