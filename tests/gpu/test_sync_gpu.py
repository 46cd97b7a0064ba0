"""Weight syncs into CUDA engines: the shm path on one GPU (in this process), the broadcast transport over nccl and
a 3-step training run through Ray (two GPUs: rlsearch gives the actor ranks and the engines GPUs of their own)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.constants import REPO_ROOT
from tests.gpu.helpers import BENCH_SHAPE, require_two_gpus, run_bench

pytestmark = pytest.mark.gpu


def test_staged_sync_into_a_cuda_engine_on_one_gpu(tiny_model_dir):
    """One GPU shared by a Megatron rank (nccl, world size 1) and a CUDA engine, both driven from this process
    without Ray. The rank's weights are perturbed, so the engine scores the probe differently; then the shm
    transport's path (buckets staged in /dev/shm, loaded in one layerwise-reload session under CUDA graphs) makes it
    score it as the actor does."""
    import torch

    from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, MegatronActorWorker, TrainSample
    from rlsearch.config import ActorConfig, AlgoConfig
    from rlsearch.loop_thread import LoopThread
    from rlsearch.rendezvous import Rendezvous
    from rlsearch.rollout import EngineSpec, VLLMEngine
    from rlsearch.weights import logprob_mismatch
    from rlsearch.weights.shm import ExportPlan

    ids = list(range(1000, 1160))
    events = LoopThread("gpu-sync")

    async def start() -> VLLMEngine:  # first: vLLM checks at start that its share of the GPU is free
        return VLLMEngine(EngineSpec(str(tiny_model_dir), max_model_len=512, kv_cache_gib=1.0,
                                     gpu_memory_utilization=0.5))

    engine = events.run(start())
    worker = MegatronActorWorker(ActorWorkerSpec(str(tiny_model_dir), "float32", ActorConfig(), AlgoConfig(),
                                                 MODEL_DISTRIBUTION, 10, 0), rank=0, world_size=1)
    rendezvous = Rendezvous("127.0.0.1", 60.0)
    try:
        worker.initialize(rendezvous.address)
        with torch.no_grad():
            for parameter in worker.model[0].parameters():
                parameter.add_(0.02 * torch.randn_like(parameter))
        actor = worker.compute_logprobs([TrainSample(ids, 1, [1] * (len(ids) - 1))])[0]
        before = logprob_mismatch(events.run(engine.score(ids)), actor)[0]
        started = time.perf_counter()
        events.run(engine.weights.open_sync())
        events.run(engine.weights.begin())
        for staged in worker.export_weight_buckets(ExportPlan(64 * 2**20, stage_in_shared_memory=True)):
            events.run(engine.weights.load_staged(staged))
        events.run(engine.weights.finish())
        seconds = time.perf_counter() - started
        after = logprob_mismatch(events.run(engine.score(ids)), actor)[0]
    finally:
        worker.shutdown()
        events.run(engine.shutdown())
        events.stop()
    print(f"[gpu] staged (shm) sync, tiny model fp32, one GPU: {seconds:.2f} s; probe gap {before:.2e} before, "
          f"{after:.2e} after", flush=True)
    assert before > 1e-2
    assert after < 1e-3


def test_broadcast_over_nccl_and_shm_syncs_pass_the_probe_check():
    """bench/weight_sync.py through Ray (an actor rank and an engine on their own GPUs): sync seconds per transport,
    and the engine's probe logprobs against the actor's after each (fp32)."""
    require_two_gpus()
    output = run_bench("weight_sync.py", "--shape", BENCH_SHAPE, "--layouts", "tp1pp1", "--engines", "1",
                       "--transports", "broadcast,shm", "--repeats", "2")
    rows = [line.split() for line in output.splitlines() if line.startswith("TP1PP1 ")]
    gaps = {row[2]: float(row[9]) for row in rows}
    assert set(gaps) == {"broadcast", "shm"}, output
    assert max(gaps.values()) < 1e-3, gaps


def test_three_training_steps(tmp_path, tiny_model_dir, toy_data):
    """`rlsearch train` on the tiny model with one engine: the run resolves weights.transport=auto to broadcast (nccl)
    from the cluster's GPUs, trains 3 steps, and every sync passes the probe check."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    require_two_gpus()
    out = tmp_path / "run"
    result = subprocess.run([
        sys.executable, "-m", "rlsearch", "train", "--config", "examples/configs/search_grpo_tiny.yaml",
        f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
        f"tools.retriever.corpus={toy_data.corpus}", f"tools.retriever.index_cache_dir={tmp_path / 'bm25'}",
        "weights.transport=auto", "weights.max_logprob_mismatch=1e-3", "trainer.total_steps=3",
        f"trainer.output_dir={out}",
    ], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    print("\n".join(f"[gpu] train: {line}" for line in result.stdout.splitlines()), flush=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["model"]["dtype"], config["weights"]["transport"]) == ("float32", "broadcast")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    syncs = [event.value for event in events.Scalars("time/sync_s")]
    print(f"[gpu] train: sync seconds per step {', '.join(f'{s:.2f}' for s in syncs)}", flush=True)
    assert len(syncs) == 3
    assert max(event.value for event in events.Scalars("weights/logprob_mismatch_max")) < 1e-3
