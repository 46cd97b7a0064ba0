"""The weight path into 2 engines x TP2: every actor layout, both transports, every engine and every engine rank.

The engines start from model A; each actor loads model B (same shape, other random weights), so an engine holds
the actor's weights only if the sync delivered them. Before each sync the engines are reset to A, and the probe
shows it (a gap far above the tolerance).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from rlsearch.actor import MODEL_DISTRIBUTION, ActorRanks, SamplingDistribution, TrainSample
from rlsearch.config import RetrieverConfig, RolloutConfig
from rlsearch.rollout import EngineSpec, RolloutWorker
from rlsearch.weights import WeightSync, WeightSyncError, check_engines_match_actor, logprob_mismatch
from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT
from tests.integration.actor_helpers import actor_spec

pytestmark = pytest.mark.memory_heavy  # holds several GiB at once: never beside another such module

ENGINES, ENGINE_TP = 2, 2
LAYOUTS = {"tp1pp1": (1, 1), "tp2pp1": (2, 1), "tp1pp2": (1, 2)}
TRANSPORTS = ("shm", "broadcast")
PROBE = ("Who is the mayor of Velmora?", "<search> who founded the town </search>")
BUCKET_MB = 2  # several buckets per stage: the embedding alone is 8.1 MiB and travels alone


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    from tests.models import make_test_model

    return make_test_model(tmp_path_factory.mktemp("model-b") / "tiny-qwen2-b", seed=7)


def _start_engine(tiny_model_dir, retriever, index: int):
    spec = EngineSpec(str(tiny_model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=768, seed=index,
                      tensor_parallel_size=ENGINE_TP, vllm_port=29600 + 100 * index)
    handle = ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=8).remote(
        spec, RolloutConfig(**TEST_ROLLOUT), RetrieverConfig(topk=2), retriever.url, 1,
    )
    ray.get(handle.__ray_ready__.remote())
    return handle


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model_dir, retriever):
    """Two RolloutWorkers with TP2 engines on model A, started one after another, each with its own port window."""
    handles = []  # a test that restarts an engine replaces its handle here
    try:
        for index in range(ENGINES):
            handles.append(_start_engine(tiny_model_dir, retriever, index))
        yield handles
    finally:
        for handle in handles:
            ray.kill(handle)


@dataclass
class LayoutSyncs:
    stats: dict = field(default_factory=dict)  # transport -> SyncStats
    before: dict = field(default_factory=dict)  # transport -> max probe gap per engine before the sync
    parity: dict = field(default_factory=dict)  # transport -> check_engines_match_actor metrics
    digests: dict = field(default_factory=dict)  # transport -> per engine, per TP rank weight hashes
    versions: dict = field(default_factory=dict)  # transport -> weight_version per engine


@pytest.fixture(scope="module")
def probe_ids(engines):
    return ray.get(engines[0].probe_sequence.remote(*PROBE))


@pytest.fixture(scope="module")
def synced(engines, tiny_model_dir, model_b, probe_ids, rank_pool):
    cache: dict[str, LayoutSyncs] = {}
    # the engines' distribution (TEST_ROLLOUT's logit bias), which the probe check scores at
    sampling = SamplingDistribution(1.0, ray.get(engines[0].token_logit_bias.remote()))

    def run(layout: str) -> LayoutSyncs:
        if layout in cache:
            return cache[layout]
        result = LayoutSyncs()
        with rank_pool.group(actor_spec(model_b, *LAYOUTS[layout], 1, {}, sampling)) as group:
            probe = TrainSample(probe_ids, 1, [1] * (len(probe_ids) - 1))
            actor_logprobs = group.compute_logprobs([probe], distribution=MODEL_DISTRIBUTION)[0]
            for transport in TRANSPORTS:
                ray.get([engine.reload_weights_from_files.remote(str(tiny_model_dir)) for engine in engines])
                result.before[transport] = [
                    logprob_mismatch(ray.get(engine.score.remote(probe_ids)), actor_logprobs)[0] for engine in engines
                ]
                sync = WeightSync(group, BUCKET_MB, transport, timeout_s=120.0, engine_tp=ENGINE_TP)
                result.stats[transport] = sync.sync(engines)
                result.parity[transport] = check_engines_match_actor(group, engines, probe_ids, 1e-4, step=0)
                result.digests[transport] = ray.get([engine.weights_digest.remote() for engine in engines])
                result.versions[transport] = ray.get([engine.finished_weight_syncs.remote() for engine in engines])
                sync.close(engines)
        cache[layout] = result
        return result

    return run


def _stage_shares(model_dir, pp: int) -> tuple[list[int], int]:
    """Payload bytes of model B's HF tensors that belong to each pipeline stage, and the number of tensors."""
    state = load_file(str(model_dir / "model.safetensors"))
    num_layers = 1 + max(int(name.split(".")[2]) for name in state if name.startswith("model.layers."))
    shares = [0] * pp
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            stage = int(name.split(".")[2]) * pp // num_layers
        else:
            stage = 0 if name.startswith("model.embed_tokens") else pp - 1
        shares[stage] += tensor.numel() * tensor.element_size()
    return shares, len(state)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fanout_every_engine_matches_the_actor_after_each_transport(synced, layout):
    result = synced(layout)
    for transport in TRANSPORTS:
        assert min(result.before[transport]) > 1e-2, "the engines did not start from other weights"
        assert result.parity[transport]["weights/logprob_mismatch_max"] <= 1e-4
        assert result.stats[transport].num_engines == ENGINES
        versions = result.versions[transport]
        assert len(set(versions)) == 1, f"engines ended with different weight versions: {versions}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_broadcast_and_shm_leave_bit_identical_engine_weights(synced, layout):
    result = synced(layout)
    shm, broadcast = result.digests["shm"], result.digests["broadcast"]
    assert len(shm) == ENGINES and all(len(ranks) == ENGINE_TP for ranks in shm)
    assert all(len(set(ranks)) == ENGINE_TP for ranks in shm)  # each TP rank holds its own shard
    assert broadcast == shm
    assert shm[0] == shm[1]  # both engines hold the same weights
    if layout != "tp1pp1":  # every actor layout delivers the same bits
        assert shm == synced("tp1pp1").digests["shm"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_stage_sender_sends_its_own_stage_share_once(synced, model_b, layout):
    _, pp = LAYOUTS[layout]
    shares, num_tensors = _stage_shares(model_b, pp)
    for transport in TRANSPORTS:
        stats = synced(layout).stats[transport]
        assert stats.stage_bytes == shares
        assert stats.num_tensors == num_tensors  # every HF name once (the engines reject repeats)
        assert stats.num_buckets > pp
        # where the seconds went: every phase of the transport measured, none longer than the sync itself
        phases = stats.phases
        expected = {"export", "pack", "load", "finish", "pause"} | ({"transfer"} if transport == "broadcast" else set())
        assert set(phases) == expected, phases
        assert all(0.0 < phases[name] for name in ("pack", "load", "finish", "pause"))
        assert max(phases["load"], phases["finish"]) <= phases["pause"] <= stats.seconds


DELTA_STEPS = 5
DELTA_LAYOUTS = ("tp2pp1", "tp1pp2")
RESTART_AFTER = 3  # in the tp1pp2 run, engine 1 is restarted after this many delta syncs


@dataclass
class DeltaRun:
    stats: list = field(default_factory=list)  # SyncStats per sync: the first (whole), then one per train step
    parity: list = field(default_factory=list)  # the probe's worst gap after each sync
    delta_digests: list = field(default_factory=list)  # per engine, per TP rank, after the last delta sync
    full_digests: list = field(default_factory=list)  # the same after a plain (whole) sync of the same weights
    restart_digests: list = field(default_factory=list)  # right after the sync that followed the restart
    killed_segments: list = field(default_factory=list)  # /dev/shm segments the killed engine's processes mapped
    left_behind: list = field(default_factory=list)  # of those (and their record), what exists once it restarted


@pytest.fixture(scope="module")
def delta_runs(engines, model_b, probe_ids, tiny_model_dir, retriever, rank_pool):
    """Per layout: DELTA_STEPS optimizer steps, each followed by a delta sync into both engines (weights.delta)."""
    from tests.integration.actor_helpers import hf_logprobs, scored_batch

    cache: dict[str, DeltaRun] = {}
    sampling = SamplingDistribution(1.0, ray.get(engines[0].token_logit_bias.remote()))
    samples, _ = scored_batch(lambda batch: hf_logprobs(model_b, batch))

    def run(layout: str) -> DeltaRun:
        if layout in cache:
            return cache[layout]
        result = DeltaRun()

        def synced(sync: WeightSync, step: int) -> None:
            result.stats.append(sync.sync(engines))
            parity = check_engines_match_actor(group, engines, probe_ids, 1e-4, step=step)
            result.parity.append(parity["weights/logprob_mismatch_max"])

        with rank_pool.group(actor_spec(model_b, *LAYOUTS[layout], 1, {}, sampling)) as group:
            sync = WeightSync(group, BUCKET_MB, "shm", timeout_s=120.0, engine_tp=ENGINE_TP, delta=True,
                              delta_full_every=10)
            synced(sync, 0)
            for step in range(1, DELTA_STEPS + 1):
                group.train_step(samples)
                if layout == "tp1pp2" and step == RESTART_AFTER + 1:
                    record = _segment_record(engines[1])
                    result.killed_segments = record.read_text().split()
                    ray.kill(engines[1])
                    engines[1] = _start_engine(tiny_model_dir, retriever, 1)
                    result.left_behind = [path.name for path in [record] + [record.parent / name for name in
                                                                            result.killed_segments] if path.exists()]
                synced(sync, step)
                if layout == "tp1pp2" and step == RESTART_AFTER + 1:
                    result.restart_digests = ray.get([engine.weights_digest.remote() for engine in engines])
            result.delta_digests = ray.get([engine.weights_digest.remote() for engine in engines])
            WeightSync(group, BUCKET_MB, "shm", timeout_s=120.0, engine_tp=ENGINE_TP).sync(engines)
            result.full_digests = ray.get([engine.weights_digest.remote() for engine in engines])
        cache[layout] = result
        return result

    return run


def _segment_record(engine) -> Path:
    """The record of the shared-memory segments of the engine's processes (`rlsearch.lifetime.SegmentRecord`)."""
    from rlsearch.lifetime import SEGMENT_DIR

    pid = ray.get(engine.__ray_call__.remote(lambda worker: os.getpid()))
    (record,) = SEGMENT_DIR.glob(f"rlsearch-segments-*-{pid}-*")
    return record


@pytest.mark.parametrize("layout", DELTA_LAYOUTS)
def test_delta_syncs_leave_the_engines_bit_identical_to_a_whole_sync(delta_runs, model_b, layout):
    result = delta_runs(layout)
    embedding_bytes = load_file(str(model_b / "model.safetensors"))["model.embed_tokens.weight"].nbytes
    assert result.full_digests[0] == result.full_digests[1]
    assert result.delta_digests == result.full_digests
    assert max(result.parity) <= 1e-4, result.parity
    first, *steps = result.stats
    assert not first.delta and first.wire_bytes >= first.num_bytes  # nothing to take a delta of yet
    restarted = RESTART_AFTER if layout == "tp1pp2" else None
    if restarted:  # the killed TP2 engine's segments (its queues, its workers' buffers) went with it
        assert len(result.killed_segments) >= 2 and result.left_behind == [], result
    for index, stats in enumerate(steps):
        assert stats.num_bytes == first.num_bytes and stats.num_engines == ENGINES
        if index == restarted:
            continue
        assert stats.delta
        # in fp32 a step moves nearly every weight, but only the embedding rows of the batch's tokens (no weight
        # decay): the embedding, half of this model, travels as a few rows
        assert stats.wire_bytes < stats.num_bytes - 0.95 * embedding_bytes, (stats.wire_bytes, stats.num_bytes)


def test_an_engine_restarted_mid_run_gets_a_whole_sync(delta_runs):
    result = delta_runs("tp1pp2")
    after_restart = result.stats[1 + RESTART_AFTER]
    assert not after_restart.delta and after_restart.wire_bytes >= after_restart.num_bytes
    assert result.restart_digests[0] == result.restart_digests[1]  # the new engine holds what the other holds
    assert result.stats[2 + RESTART_AFTER].delta  # and the sync after it is a delta again


def test_staged_while_generating_the_engines_keep_sampling_until_the_load(
    engines, model_b, probe_ids, rank_pool
):
    """With weights.stage_while_generating the buckets are staged before the engines pause: the engines pause only
    once the senders have exported and staged every bucket, requests in flight meanwhile go on, and the pause is
    only the load and the reset. (The TP2 export of this tiny model takes 0.15-1 s on 2 cores, too short a window to
    count the requests that finish in it; the window is checked to hold the export instead.)"""
    import threading

    with rank_pool.group(actor_spec(model_b, 2, 1, 1, {})) as group:
        finished: list[float] = []
        stop = threading.Event()

        def sample() -> None:
            seed = 0
            while not stop.is_set():
                ray.get(engines[0].sample_probe.remote(probe_ids, 4, seed))
                finished.append(time.time())
                seed += 1

        sampler = threading.Thread(target=sample)
        try:
            WeightSync(group, BUCKET_MB, "shm", timeout_s=120.0, engine_tp=ENGINE_TP).sync(engines)  # warm-up
            sampler.start()
            while not finished:
                time.sleep(0.05)
            stats = WeightSync(group, BUCKET_MB, "shm", timeout_s=120.0, engine_tp=ENGINE_TP,
                               stage_while_generating=True).sync(engines)
            timeline = ray.get(engines[0].weight_sync_timeline.remote())
        finally:
            stop.set()
            if sampler.is_alive():
                sampler.join(timeout=60)
    phases = stats.phases
    # an engine paused at the sync's opening (the sync not staged first) would show a window of milliseconds
    assert timeline["paused"] - timeline["opened"] >= 0.9 * (phases["export"] + phases["pack"]), (timeline, phases)
    assert any(t > timeline["resumed"] for t in finished)  # the sampler's requests went on through the sync
    assert phases["pause"] < stats.seconds
    assert phases["pause"] <= timeline["resumed"] - timeline["paused"] + 0.5
    assert stats.num_engines == ENGINES and stats.num_bytes > 0


def test_broadcast_sync_into_a_dead_engine_raises_within_the_timeout(engines, model_b):
    """Run last in this module: it kills engine 1."""
    group = ActorRanks(actor_spec(model_b, 1, 1, 1, {}))
    try:
        sync = WeightSync(group, BUCKET_MB, "broadcast", timeout_s=20.0, engine_tp=ENGINE_TP)
        sync.sync(engines)
        ray.kill(engines[1])
        started = time.perf_counter()
        with pytest.raises(WeightSyncError, match="engine 1 died"):
            sync.sync(engines)
        seconds = time.perf_counter() - started
        assert seconds < 5 * 20.0, f"hang guard: a sync with a 20 s timeout raised after {seconds:.0f} s"
    finally:
        group.shutdown()
