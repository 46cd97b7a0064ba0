"""The sender's side of a weight sync, phase by phase, against the copy limit (one rank, no Ray).

See docs/benchmarks.md#gpu_weight_export."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from bench.gpu_actor_check import grpo_step, start_single_rank_worker  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, *args) -> tuple[float, object]:
    _sync()
    started = time.perf_counter()
    result = fn(*args)
    _sync()
    return time.perf_counter() - started, result


def _all_buckets(worker, plan) -> list:
    return list(worker.export_weight_buckets(plan))


def _parameters(worker) -> list[torch.Tensor]:
    return [p.detach() for chunk in worker.model for p in chunk.parameters()]


def copy_limits(worker, repeats: int) -> dict[str, float]:
    """Best seconds of copying every parameter's bytes once into each kind of destination."""
    from rlsearch.weights.shm import STAGING_DIR

    params = _parameters(worker)
    total = sum(p.numel() * p.element_size() for p in params)
    path = os.path.join(STAGING_DIR, f"rlsearch-bench-copy-{os.getpid()}")
    mapping = np.memmap(path, dtype=np.uint8, mode="w+", shape=(total,))
    mapping[:] = 1  # its pages exist, as a sender's files do from its second sync on
    on_gpu = params[0].is_cuda
    targets = {"to pageable host memory": torch.empty(total, dtype=torch.uint8),
               "to a mapped /dev/shm file": torch.from_numpy(mapping)}
    if on_gpu:
        targets["to pinned host memory"] = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        targets["device to device"] = torch.empty(total, dtype=torch.uint8, device=params[0].device)
        locked = np.memmap(path + "-locked", dtype=np.uint8, mode="w+", shape=(total,))
        locked[:] = 1
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(locked.ctypes.data, total, 0))
        targets["to a page-locked /dev/shm file"] = torch.from_numpy(locked)

    def copy_into(target: torch.Tensor) -> None:
        offset = 0
        for p in params:
            size = p.numel() * p.element_size()
            target[offset:offset + size].copy_(p.reshape(-1).view(torch.uint8))
            offset += size

    seconds = {}
    try:
        for name, target in targets.items():
            seconds[name] = min(_timed(copy_into, target)[0] for _ in range(repeats))
    finally:
        if on_gpu:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(locked.ctypes.data))
            del locked
            os.unlink(path + "-locked")
        del targets, mapping
        os.unlink(path)
    return seconds


def shm_syncs(worker, bucket_bytes: int, repeats: int) -> list[tuple[float, dict[str, float], int]]:
    """`repeats` shm syncs staged in /dev/shm: (seconds, the sender's phases, buckets) of each."""
    from rlsearch.weights.shm import ExportPlan

    plan = ExportPlan(bucket_bytes, stage_in_shared_memory=True)
    runs = []
    for _ in range(repeats):
        seconds, buckets = _timed(_all_buckets, worker, plan)
        runs.append((seconds, worker.send_phases(), len(buckets)))
    return runs


def staged_read_back(worker, bucket_bytes: int, expected: dict[str, torch.Tensor]) -> list[str]:
    """One sync staged whole (every bucket its own file), each file read back through its checksum; the names whose
    bytes differ from `expected` (or are missing)."""
    from rlsearch.weights.bucket import FlatLayout, unflatten_tensors
    from rlsearch.weights.shm import ExportPlan

    staged = list(worker.export_weight_buckets(ExportPlan(bucket_bytes, True, keep_staged=True)))
    received = {}
    for bucket in staged:
        layout = FlatLayout.from_wire(bucket["layout"])
        flat = torch.from_numpy(np.memmap(bucket["path"], dtype=np.uint8, mode="c", shape=(layout.total_bytes,)))
        for name, tensor in unflatten_tensors(layout, flat):
            received[name] = tensor.clone()
    return [name for name, tensor in expected.items()
            if name not in received or not torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8))]


def broadcast_sync(worker, bucket_bytes: int) -> tuple[float, dict[str, float]]:
    """The broadcast transport's sender on the rank's own group (no receiver: the group has one member)."""
    import torch.distributed as dist

    from rlsearch.weights.bucket import flatten_tensors, iter_buckets
    from rlsearch.weights.clock import PhaseClock
    from rlsearch.weights.process_group import broadcast_within, group_device

    clock = PhaseClock()
    device = group_device(dist.get_backend())

    def send() -> None:
        for tensors in iter_buckets(clock.timed("export", worker.stage_weights()),
                                    bucket_bytes):
            with clock.phase("pack"):
                _, flat = flatten_tensors(tensors, device)
            with clock.phase("transfer"):
                broadcast_within(flat, dist.group.WORLD, 60.0)
                _sync()

    seconds, _ = _timed(send)
    return seconds, clock.seconds


def delta_syncs(worker, bucket_bytes: int, samples) -> dict:
    """A whole sync, one GRPO step, a delta sync; the engine side's `DeltaBase` applies both. Returns the bytes and
    seconds of each and the names whose applied bytes differ from the trained weights."""
    from rlsearch.weights.bucket import unpack_bucket
    from rlsearch.weights.delta import DeltaBase
    from rlsearch.weights.shm import ExportPlan

    base = DeltaBase()
    result = {}
    for sync_id, delta_of in (("first", None), ("second", "first")):
        if delta_of is not None:
            result["step_s"], stats = _timed(grpo_step, worker, samples)
            result["grad_norm"] = stats["grad_norm"]
        plan = ExportPlan(bucket_bytes, stage_in_shared_memory=False, sync_id=sync_id, delta_of=delta_of)
        seconds, buckets = _timed(_all_buckets, worker, plan)
        base.start()
        for bucket in buckets:
            unpack_bucket(base.apply(bucket))  # the checksum the engine's workers verify
        base.finish(sync_id)
        result[sync_id] = {"seconds": seconds, "phases": worker.send_phases(),
                           "payload": sum(b.payload_bytes for b in buckets),
                           "wire": sum(b.wire_bytes for b in buckets)}
    trained = {name: tensor.cpu() for name, tensor in worker.export_hf_weights()}
    result["differs"] = [name for name, tensor in trained.items()
                         if not torch.equal(base.tensors[name].view(torch.uint8), tensor.view(torch.uint8))]
    return result


def _phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, default=256, help="weights.bucket_mb")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs (and copies) of each kind")
    parser.add_argument("--lr", type=float, default=1e-6, help="the learning rate of the step between delta syncs")
    parser.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    add_vocab_ranks_argument(parser)
    return parser


def run(args: argparse.Namespace, worker) -> list[str]:
    """The copy limits, the shm, broadcast and delta syncs of the worker's weights; what failed."""
    from bench.train_step import make_samples

    bucket_bytes = args.bucket_mb << 20
    total = worker.export_bytes()
    gb = total / 1e9
    failures = []
    print(f"weights: {gb:.3f} GB", flush=True)

    limits = copy_limits(worker, args.repeats)
    for name, seconds in limits.items():
        print(f"copy limit {name:26s}: {seconds:.3f} s ({gb / seconds:6.1f} GB/s)", flush=True)

    runs = shm_syncs(worker, bucket_bytes, args.repeats)
    for index, (seconds, phases, buckets) in enumerate(runs):
        print(f"shm sync {index + 1}: {seconds:.3f} s ({gb / seconds:.1f} GB/s, {buckets} buckets): "
              f"{_phases(phases)}", flush=True)
    best = min(seconds for seconds, _, _ in runs)
    limit = limits.get("to a page-locked /dev/shm file", limits["to a mapped /dev/shm file"])
    print(f"shm sync / the copy into a mapped file (page-locked on a GPU): {best / limit:.2f}x", flush=True)
    expected = {name: tensor.cpu() for name, tensor in worker.export_hf_weights()}
    differs = staged_read_back(worker, bucket_bytes, expected)
    print(f"staged read-back: {len(expected) - len(differs)}/{len(expected)} tensors bit-identical", flush=True)
    if differs:
        failures.append(f"staged bytes differ from the weights: {differs[:5]}")

    seconds, phases = min((broadcast_sync(worker, bucket_bytes) for _ in range(args.repeats)), key=lambda r: r[0])
    device_copy = limits.get("device to device", limits["to pageable host memory"])
    print(f"broadcast sender: {seconds:.3f} s ({gb / seconds:.1f} GB/s): {_phases(phases)}; "
          f"/ the plain copy {seconds / device_copy:.2f}x", flush=True)

    delta = delta_syncs(worker, bucket_bytes, make_samples(8, 150, 600, seed=0, vocab_ranks=args.vocab_ranks))
    first, second = delta["first"], delta["second"]
    print(f"delta: whole sync {first['seconds']:.3f} s, {first['wire'] / 1e6:.1f} MB ({_phases(first['phases'])}); "
          f"one step at lr {args.lr:g} ({delta['step_s']:.2f} s, grad norm {delta['grad_norm']:.3f}); delta sync "
          f"{second['seconds']:.3f} s, {second['wire'] / 1e6:.2f} MB on the wire ({_phases(second['phases'])}): "
          f"{first['wire'] / max(second['wire'], 1):.1f}x fewer bytes", flush=True)
    if delta["differs"]:
        failures.append(f"deltas applied differ from the trained weights: {delta['differs'][:5]}")
    return failures


def main() -> None:
    args = parse_args(_parser(), dict(shape="tiny", dtype="float32", repeats=1, vocab_ranks=SMOKE_VOCAB_RANKS))

    from rlsearch.config import ActorConfig, AlgoConfig

    on_gpu = torch.cuda.is_available()
    print(f"device: {torch.cuda.get_device_name(0) if on_gpu else 'cpu'}; torch {torch.__version__}; "
          f"model: random Qwen2 '{args.shape}', {args.dtype}; buckets of {args.bucket_mb} MB", flush=True)
    model_path = build_model(args.shape, Path(args.out), vocab_ranks=args.vocab_ranks)
    worker = start_single_rank_worker(model_path, args.dtype, ActorConfig(lr=args.lr, lr_warmup_steps=0),
                                      AlgoConfig(kl_coef=0.0), 4)
    failures = run(args, worker)
    worker.shutdown()
    print("FAIL: " + "; ".join(failures) if failures else "PASS", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
