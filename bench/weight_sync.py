"""Weight sync from Megatron layouts into vLLM, against vLLM reloading the same weights from memory.

For a random model shaped like Qwen2.5-0.5B (tied embeddings, 494M parameters) this measures, in one run:
  baseline : vLLM `reload_weights` from the model's safetensors files, already in the page cache (the engine is
             vLLM's AsyncLLM: its model lives in the EngineCore process, where no state dict of ours can wait)
  sync     : the bridge (gather TP/PP shards -> HF names -> buckets -> object store -> shared-memory staging file
             -> engine), per layout
and prints seconds, bytes moved and the sender's peak extra RSS (rank 0, the process that packs buckets). The
last line is the figure: sync seconds / baseline seconds (goal <= 2.0).

  .venv/bin/python bench/weight_sync.py                    # 0.5B shape, TP1PP1 and TP2PP2, fp32
  .venv/bin/python bench/weight_sync.py --shape tiny       # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import SHAPES, build_model  # noqa: E402


class EngineHost:
    """A Ray actor around one rollout engine (on its event loop thread, as a rollout worker holds it), with the
    baseline: vLLM's own `reload_weights` from the model's safetensors files, already in the page cache."""

    def __init__(self, model_path: str, dtype: str) -> None:
        from rlsearch.rollout import EngineSpec
        from rlsearch.rollout.engine import VLLMEngine
        from rlsearch.tools.loop_thread import LoopThread

        self.events = LoopThread("engine-host")

        async def start() -> VLLMEngine:
            return VLLMEngine(EngineSpec(model_path, dtype=dtype, max_model_len=256))

        self.engine = self.events.run(start())
        self.model_path = model_path
        self.dtype = dtype

    def model_bytes(self) -> int:
        """The model's size in the engine's dtype (read from the safetensors headers, then the page cache warmed)."""
        import torch
        from safetensors import safe_open

        element_size = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        numel = 0
        for shard in sorted(Path(self.model_path).glob("*.safetensors")):
            with safe_open(str(shard), "pt") as tensors:
                for name in tensors.keys():
                    shape = tensors.get_slice(name).get_shape()
                    numel += int(torch.Size(shape).numel())
            shard.read_bytes()
        return numel * element_size

    def timed_reload_from_files(self) -> float:
        async def reload() -> float:
            started = time.perf_counter()
            await self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.model_path})
            await self.engine.reset_prefix_cache()
            return time.perf_counter() - started

        return self.events.run(reload())

    def begin_weight_update(self) -> None:
        self.events.run(self.engine.begin_weight_update())

    def load_weight_bucket(self, bucket) -> tuple[int, int]:
        return self.events.run(self.engine.load_weight_bucket(bucket))

    def finish_weight_update(self) -> None:
        self.events.run(self.engine.finish_weight_update())

    def score(self, token_ids: list[int]) -> list[float]:
        return self.events.run(self.engine.score(token_ids))

    def shutdown(self) -> None:
        self.events.run(self.engine.shutdown())


class PeakRss:
    """Samples a process's private (anonymous) and shared resident memory in a thread; `peak_extra_*` is the rise
    above the starting values. Shared pages are the object-store copies the sender writes."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.status = Path(f"/proc/{pid}/status")
        self.interval_s = interval_s
        self.start = self.peak = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _read(self) -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in self.status.read_text().splitlines() if ":" in line)
        return tuple(int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssShmem"))

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = tuple(max(a, b) for a, b in zip(self.peak, self._read()))
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_extra_private(self) -> int:
        return self.peak[0] - self.start[0]

    @property
    def peak_extra_shared(self) -> int:
        return self.peak[1] - self.start[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--layouts", default="tp1pp1,tp2pp2", help="comma-separated tpXppY layouts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed repetitions (the best is reported)")
    parser.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    from rlsearch.actor import ActorGroup, ActorWorkerSpec, TrainSample
    from rlsearch.bridge import logprob_mismatch, sync_weights
    from rlsearch.config import ActorConfig, AlgoConfig
    from rlsearch.trainer import init_ray

    model_path = build_model(args.shape, Path(args.out))
    init_ray(num_cpus=8)
    engine = ray.remote(EngineHost).options(num_cpus=0).remote(str(model_path), args.dtype)
    model_bytes = ray.get(engine.model_bytes.remote())
    baseline = min(ray.get(engine.timed_reload_from_files.remote()) for _ in range(args.repeats))
    print(f"model: {args.shape} shape, {model_bytes / 2**20:.0f} MiB in {args.dtype}")
    print(f"baseline  vLLM reload_weights from the safetensors files (page cache): {baseline:.2f} s")

    probe = list(range(1000, 1064))
    ratios = {}
    for layout in args.layouts.split(","):
        tp, pp = (int(part) for part in layout.removeprefix("tp").split("pp"))
        actor = ActorConfig(tp=tp, pp=pp)
        group = ActorGroup(ActorWorkerSpec(str(model_path), args.dtype, actor, AlgoConfig(), 1.0, 1, 1))
        try:
            sender_pid = ray.get(group.workers[0].__ray_call__.remote(lambda worker: os.getpid()))
            timings, peak_private, peak_shared = [], 0, 0
            for _ in range(args.repeats):
                with PeakRss(sender_pid) as rss:
                    stats = sync_weights(group, [engine], args.bucket_mb)
                timings.append(stats.seconds)
                peak_private = max(peak_private, rss.peak_extra_private)
                peak_shared = max(peak_shared, rss.peak_extra_shared)
            actor_logprobs = group.compute_logprobs([TrainSample(probe, 1, [1] * (len(probe) - 1))])[0]
            mismatch = logprob_mismatch(ray.get(engine.score.remote(probe)), actor_logprobs)[0]
        finally:
            group.shutdown()
        ratios[layout] = min(timings) / baseline
        print(
            f"sync      {layout.upper()}: {min(timings):.2f} s  "
            f"({stats.num_buckets} buckets of <= {args.bucket_mb:g} MiB, "
            f"{stats.num_bytes / 2**20:.0f} MiB moved; sender peak extra memory {peak_private / 2**20:.0f} MiB private "
            f"+ {peak_shared / 2**20:.0f} MiB object store; "
            f"engine vs actor max |dlogprob| {mismatch:.1e})"
        )
    ray.get(engine.shutdown.remote())
    summary = ", ".join(f"{layout.upper()} {ratio:.2f}x" for layout, ratio in ratios.items())
    print(f"weight sync / vLLM reload_weights from the page cache (goal <= 2.0): {summary}")


if __name__ == "__main__":
    main()
