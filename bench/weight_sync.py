"""Weight sync from Megatron layouts into N vLLM engines against vLLM reloading the weights from files; with
--lora-rank, a LoRA actor's merged syncs against its adapter syncs (actor.lora.sync=adapter, transport `adapter`).

See docs/benchmarks.md#weight_sync."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from bench.common.memory import proc_status  # noqa: E402
from bench.common.table import header_lines, print_table, row_line  # noqa: E402


class PeakRss:
    """Samples processes' private (anonymous) and shared resident memory in a thread; `peak_extra_*` is the largest
    rise above the starting values over the processes. Shared pages are the object-store copies a sender writes."""

    def __init__(self, pids: list[int], interval_s: float = 0.005) -> None:
        self.statuses = [Path(f"/proc/{pid}/status") for pid in pids]
        self.interval_s = interval_s
        self.start = [self._read(status) for status in self.statuses]
        self.peak = list(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _read(status: Path) -> tuple[int, int]:
        """(private, shared) resident bytes; zeros once the process is gone."""
        fields = proc_status(status.parent.name)
        return fields.get("RssAnon", 0), fields.get("RssShmem", 0)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for index, status in enumerate(self.statuses):
                self.peak[index] = tuple(max(a, b) for a, b in zip(self.peak[index], self._read(status)))
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_extra_private(self) -> int:
        return max(peak[0] - start[0] for peak, start in zip(self.peak, self.start))

    @property
    def peak_extra_shared(self) -> int:
        return max(peak[1] - start[1] for peak, start in zip(self.peak, self.start))


def _largest_tensor_bytes(model_path: Path, dtype: str) -> int:
    import torch
    from safetensors import safe_open

    element_size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    largest = 0
    for shard in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as tensors:
            for name in tensors.keys():
                largest = max(largest, int(torch.Size(tensors.get_slice(name).get_shape()).numel()))
            shard.read_bytes()  # into the page cache, for the baseline
    return largest * element_size


def print_phases(phases: dict[tuple[str, int, str], dict[str, float]],
                 seconds: dict[tuple[str, int, str], float]) -> None:
    from rlsearch.weights.clock import PHASES

    print("seconds per phase of the fastest sync:")
    for name, what in PHASES.items():
        print(f"  {name:<9} {what}")
    print_table([*SYNC_COLUMNS[:4], *((name, ">8.2f") for name in PHASES)], [
        (layout.upper(), count, transport, seconds[(layout, count, transport)],
         *(times.get(name, 0.0) for name in PHASES))
        for (layout, count, transport), times in phases.items()
    ], rule=False)


# the sync table's columns (its first four begin the phase table's too)
SYNC_COLUMNS = [("layout", "<8"), ("engines", ">7"), ("transport", "<10"), ("sync s", ">7.2f"), ("/base", ">6"),
                ("pause s", ">7.2f"), ("MiB/eng", ">8.0f"), ("MiB wire", ">8.1f"), ("peak MiB", ">9.0f"),
                ("shm MiB", ">8.0f"), ("buckets", ">7.2f"), ("probe gap", ">9.1e")]

# bench transport -> (weights.transport, WeightSync options); `adapter` is AdapterSync (--lora-rank)
TRANSPORTS = {
    "shm": ("shm", {}), "broadcast": ("broadcast", {}),
    "shm-staged": ("shm", {"stage_while_generating": True}), "shm-delta": ("shm", {"delta": True}),
    "adapter": ("adapter", {}),
}


def train_sample(group, length: int = 64):
    """A 64-token sample scored by the actor, with an advantage, for one optimizer step."""
    from rlsearch.actor import MODEL_DISTRIBUTION, TrainSample
    from rlsearch.algo import loss_token_weights

    sample = TrainSample(list(range(2000, 2000 + length)), 1, [1] * (length - 1))
    sample.old_logprobs = list(group.compute_logprobs([sample], distribution=MODEL_DISTRIBUTION)[0])
    sample.advantage = 1.0
    sample.token_weights = loss_token_weights([sample.loss_mask], "token_mean")[0]
    return sample


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--layouts", default="tp1pp1,tp2pp2", help="comma-separated actor layouts tpXppY")
    parser.add_argument("--engines", default="1,2", help="comma-separated numbers of engines to sync into")
    parser.add_argument("--engine-tp", type=int, default=1, help="tensor_parallel_size of every engine")
    parser.add_argument("--transports", default="shm,broadcast",
                        help="comma-separated: " + ", ".join(TRANSPORTS))
    parser.add_argument("--lr", type=float, default=1e-6, help="the actor's learning rate (shm-delta's steps)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed repetitions (the best is reported)")
    parser.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="a LoRA actor of this rank (alpha 2x rank, one step taken before the syncs) and engines "
                             "with vLLM's LoRA on: its merged syncs (shm, broadcast) against transport adapter")
    add_vocab_ranks_argument(parser)
    return parser


def report(args: argparse.Namespace, engine_counts: list[int], seconds: dict, bests: dict, baseline: float) -> None:
    """The fan-out, the staged pause, the delta's bytes and the worst sync against the goals."""
    if len(engine_counts) > 1:
        one, most = min(engine_counts), max(engine_counts)
        fanout = {(layout, transport): seconds[(layout, most, transport)] / seconds[(layout, one, transport)]
                  for layout, count, transport in seconds if count == one}
        print(f"fan-out {most} engines / {one} (goal <= 1.15): " + ", ".join(
            f"{layout.upper()} {transport} {ratio:.2f}x" for (layout, transport), ratio in fanout.items()))
    for (layout, count, transport), stats in bests.items():
        if transport == "shm-staged":
            print(f"pause / sync staged first (goal <= 0.25): {layout.upper()}, {count} engine(s): "
                  f"{stats.phases['pause'] / stats.seconds:.2f} ({stats.phases['pause']:.2f} of {stats.seconds:.2f} s)")
        if transport == "shm-delta":
            print(f"whole / delta bytes at lr {args.lr:g} (goal >= 20): {layout.upper()}, {count} engine(s): "
                  f"{stats.num_bytes / max(stats.wire_bytes, 1):.1f}x ({stats.wire_bytes / 2**20:.1f} of "
                  f"{stats.num_bytes / 2**20:.0f} MiB)")
    for (layout, count, transport), stats in bests.items():
        merged = bests.get((layout, count, "shm"))
        if transport == "adapter" and merged is not None:
            print(f"adapter / merged sync (goals bytes <= 0.05, seconds <= 0.3): {layout.upper()}, {count} engine(s): "
                  f"bytes {stats.num_bytes / merged.num_bytes:.4f} ({stats.num_bytes / 2**20:.2f} of "
                  f"{merged.num_bytes / 2**20:.0f} MiB), seconds {stats.seconds / merged.seconds:.2f} "
                  f"({stats.seconds:.3f} of {merged.seconds:.3f} s)")
    # a delta sync trades the senders' and engines' time for bytes on the wire: it is not a way to sync faster
    timed = {key: value for key, value in seconds.items() if key[2] != "shm-delta"}
    if timed:
        worst = max(timed, key=timed.get)
        print(f"worst sync / vLLM reload from the page cache: {timed[worst] / baseline:.2f}x "
              f"({worst[0].upper()}, {worst[1]} engine(s), {worst[2]}; goals TP1PP1 <= 1.3, TP2PP2 <= 1.5)")


def start_pool(args: argparse.Namespace, model_path: Path, engine_counts: list[int], lora_rank: int = 0):
    """The rollout engines the syncs go to: as many as the largest count of --engines; with `lora_rank`, vLLM's LoRA
    on (an adapter sync's engines: their LoRA-wrapped layers take no whole weights)."""
    from rlsearch.config import RolloutConfig, ToolsConfig
    from rlsearch.rollout import EnginePool, EngineSpec

    rollout = RolloutConfig(num_engines=max(engine_counts), tensor_parallel_size=args.engine_tp, max_prompt_tokens=128,
                            max_response_tokens=128)
    tools = ToolsConfig()
    tools.retriever.url = "http://127.0.0.1:9"  # the agent's search client is built but never called here
    return EnginePool(EngineSpec(str(model_path), dtype=args.dtype, max_model_len=256,
                                 tensor_parallel_size=args.engine_tp, lora_rank=lora_rank), rollout, tools, seed=1)


def reload_seconds(pool, model_path: Path) -> float:
    """The baseline: the first engine's vLLM reload of the weights from the safetensors files."""
    import ray

    started = time.perf_counter()
    ray.get(pool.engines[0].reload_weights_from_files.remote(str(model_path)))
    return time.perf_counter() - started


def measure_layout(args: argparse.Namespace, layout: str, model_path: Path, pools: dict, engine_counts: list[int],
                   baseline: float, bucket_bytes: int, seconds: dict, phases: dict, bests: dict) -> None:
    """Every engine count and transport of one actor layout: a row each (the best of --repeats syncs), into
    `seconds`, `phases` and `bests`. `pools`: the engines of whole-weight syncs ("weights") and of adapter ones."""
    import ray

    from rlsearch.actor import MODEL_DISTRIBUTION, ActorRanks, ActorWorkerSpec
    from rlsearch.config import ActorConfig, AlgoConfig
    from rlsearch.config.schema import LoRAConfig
    from rlsearch.ray_setup import cluster_has_gpus
    from rlsearch.weights import AdapterSync, WeightSync, check_engines_match_actor

    probe_ids = list(range(1000, 1064))
    tp, pp = (int(part) for part in layout.removeprefix("tp").split("pp"))
    lora = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else LoRAConfig()
    # LoRA: a 10x learning rate, as LoRA runs take (the step before the syncs makes the adapters non-zero)
    actor = ActorConfig(tp=tp, pp=pp, lr=args.lr * (10 if args.lora_rank else 1), lora=lora,
                        transformer_impl="local" if args.lora_rank else "auto")
    spec = ActorWorkerSpec(str(model_path), args.dtype, actor, AlgoConfig(), MODEL_DISTRIBUTION, 100, 1)
    group = ActorRanks(spec, num_gpus_per_rank=1 if cluster_has_gpus() else 0)
    try:
        if args.lora_rank:
            group.train_step([train_sample(group)])
        senders = [workers[0] for workers in group.stage_workers()]
        pids = ray.get([sender.__ray_call__.remote(lambda worker: os.getpid()) for sender in senders])
        for count in engine_counts:
            for transport in args.transports.split(","):
                engines = pools["adapter" if transport == "adapter" else "weights"].engines[:count]
                bridge_transport, options = TRANSPORTS[transport]
                if transport == "adapter":
                    sync = AdapterSync(group, lora.rank, lora.alpha, timeout_s=600.0)
                else:
                    sync = WeightSync(group, args.bucket_mb, bridge_transport, timeout_s=600.0,
                                      engine_tp=args.engine_tp, **options)
                if options.get("delta"):
                    sync.sync(engines)  # the first is whole
                    sample = train_sample(group)
                timings, private, shared, best = [], 0, 0, None
                for _ in range(args.repeats):
                    if options.get("delta"):
                        group.train_step([sample])
                    with PeakRss(pids) as rss:
                        stats = sync.sync(engines)
                    if best is None or stats.seconds < best.seconds:
                        best = stats
                    timings.append(stats.seconds)
                    private = max(private, rss.peak_extra_private)
                    shared = max(shared, rss.peak_extra_shared)
                gap = check_engines_match_actor(group, engines, probe_ids, 0.0, step=0)
                sync.close(engines)
                seconds[(layout, count, transport)] = best.seconds
                phases[(layout, count, transport)] = best.phases
                bests[(layout, count, transport)] = best
                print(row_line(SYNC_COLUMNS, (
                    layout.upper(), count, transport, best.seconds, f"{best.seconds / baseline:.2f}x",
                    best.phases.get("pause", 0.0), best.num_bytes / 2**20, best.wire_bytes / 2**20, private / 2**20,
                    shared / 2**20, private / bucket_bytes, gap["weights/logprob_mismatch_max"])), flush=True)
    finally:
        group.shutdown()


def main() -> None:
    args = parse_args(_parser(), dict(shape="tiny", layouts="tp1pp1", engines="1", transports="shm,adapter", repeats=1,
                                   vocab_ranks=SMOKE_VOCAB_RANKS, lora_rank=8))
    if "adapter" in args.transports.split(",") and not args.lora_rank:
        raise SystemExit("weight_sync.py: transport adapter syncs a LoRA actor's adapters: give --lora-rank")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlsearch.ray_setup import init_ray

    engine_counts = [int(n) for n in args.engines.split(",")]
    model_path = build_model(args.shape, Path(args.out), vocab_ranks=args.vocab_ranks)
    largest = _largest_tensor_bytes(model_path, args.dtype)
    bucket_bytes = max(args.bucket_mb * 2**20, largest)
    init_ray(num_cpus=8 + max(engine_counts) * args.engine_tp)
    seconds: dict[tuple[str, int, str], float] = {}
    phases: dict[tuple[str, int, str], dict[str, float]] = {}
    bests: dict = {}  # the fastest sync's SyncStats per run
    pool = start_pool(args, model_path, engine_counts)
    pools = {"weights": pool}
    try:
        if "adapter" in args.transports.split(","):
            pools["adapter"] = start_pool(args, model_path, engine_counts, args.lora_rank)
        # the best of several reloads, before the syncs and again after them (the machine's noise moves it)
        baseline = min(reload_seconds(pool, model_path) for _ in range(args.repeats + 1))
        print(f"model: {args.shape} shape in {args.dtype}; engines TP{args.engine_tp}; buckets of "
              f"{args.bucket_mb:g} MiB (largest tensor {largest / 2**20:.0f} MiB)")
        print(f"baseline: vLLM reload_weights from the safetensors files (page cache), one engine: {baseline:.2f} s")
        print("\n".join(header_lines(SYNC_COLUMNS, rule=False)))
        for layout in args.layouts.split(","):
            measure_layout(args, layout, model_path, pools, engine_counts, baseline, bucket_bytes, seconds, phases,
                           bests)
        after = min(reload_seconds(pool, model_path) for _ in range(args.repeats + 1))
        if after < baseline:
            print(f"baseline measured again after the syncs: {after:.2f} s (the ratios above used {baseline:.2f} s)")
            baseline = after
    finally:
        for started in pools.values():
            started.shutdown()
        print_phases(phases, seconds)  # also when a run failed part-way (e.g. out of memory): what was measured
    report(args, engine_counts, seconds, bests, baseline)


if __name__ == "__main__":
    main()
