"""EnginePool: N rollout engines, each tensor-parallel, give the same trajectories as one engine.

Real vLLM engines (tiny model, real BM25 server over HTTP): 2 x TP1 and 1 x TP2 run the same items at the same step,
one pool after another (3 engine starts in all), against one engine's trajectories: engine 0 of the 2 x TP1 pool, fresh,
given every group itself, one after another as a pool of one engine with one group in flight deals them (before
2026-11-29 a 1 x TP1 pool of its own, a fourth start). The last engine of each pool is then killed with SIGKILL: Ray
sees it die and its vLLM processes (a forked EngineCore, TP workers) go. A pool of stand-in workers (no vLLM) checks
the Ray side cheaply: placement, per-engine seeds and ports, a dying engine, restart, shutdown.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest
import ray

from rlsearch.config import RetrieverConfig, RolloutConfig, ToolsConfig
from rlsearch.data import load_qa_dataset
from rlsearch.rollout import EnginePool, EngineSpec, PromptItem, Trajectory
from rlsearch.trainer.placement import check_retriever_reachable, describe_placement
from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT

pytestmark = pytest.mark.memory_heavy  # holds several GiB at once: never beside another such module

LAYOUTS = [(2, 1), (1, 2)]  # (engines, tensor_parallel_size)
REFERENCE = "one engine"
KILLED = "killed"
GROUPS, GROUP_SIZE, STEP, SEED = 4, 3, 3, 11


def _tools(retriever) -> ToolsConfig:
    return ToolsConfig(retriever=RetrieverConfig(url=retriever.url, topk=2, max_retries=1, backoff_s=0.05, timeout_s=5))


def _items(toy_data) -> list[PromptItem]:
    examples = load_qa_dataset(toy_data.train)[:GROUPS]
    return [PromptItem(e.id, e.question, group_id=g, sample_index=s) for g, e in enumerate(examples)
            for s in range(GROUP_SIZE)]


def _one_engine(engine, items: list[PromptItem]) -> list[Trajectory]:
    """`items` run on `engine` alone, a group at a time (as a pool of one engine with groups_per_engine 1)."""
    groups = sorted({item.group_id for item in items})
    return [trajectory for group in groups
            for trajectory in ray.get(engine.generate.remote([i for i in items if i.group_id == group], STEP))]


@pytest.fixture(scope="module")
def runs(ray_local, tiny_model_dir, retriever, toy_data):
    """layout -> (trajectories, last_metrics, start-up line, seconds to start, seconds to generate); REFERENCE -> one
    engine's trajectories"""
    results = {}
    for engines, tp in LAYOUTS:
        rollout = RolloutConfig(**TEST_ROLLOUT, num_engines=engines, tensor_parallel_size=tp, groups_per_engine=1)
        spec = EngineSpec(str(tiny_model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=768,
                          tensor_parallel_size=tp)
        started = time.perf_counter()
        pool = EnginePool(spec, rollout, _tools(retriever), SEED)
        start_s = time.perf_counter() - started
        try:
            if REFERENCE not in results:  # before the pool's own rollout: a fresh engine, as a pool of one has
                results[REFERENCE] = _one_engine(pool.engines[0], _items(toy_data))
            started = time.perf_counter()
            trajectories = pool.generate(_items(toy_data), STEP)
            generate_s = time.perf_counter() - started
            results[(engines, tp)] = (trajectories, pool.last_metrics(), pool.describe(), start_s, generate_s)
            results[KILLED, (engines, tp)] = _kill(pool.engines[-1])
            children, ended, dead_after_s, alive = results[KILLED, (engines, tp)]
            print(f"\n{engines} x TP{tp}: a killed engine's {children} vLLM processes, the next call ended by "
                  f"{ended} after {dead_after_s:.1f} s, {len(alive)} alive 15 s later")
        finally:
            pool.shutdown()
        summary = pool_summary(results[(engines, tp)][1])
        print(f"\n{engines} x TP{tp}: start {start_s:.1f} s, generate {generate_s:.1f} s, {summary}")
    return results


DEATH_HANG_GUARD_S = 120  # a call to a killed engine not told apart from a live one by then never will be


def _kill(engine) -> tuple[int, str, float, list[str]]:
    """Kill `engine`'s Ray actor process with SIGKILL: its vLLM child processes, how the next call to it ended (a kind
    of Ray's RayActorError: it saw the actor go), the seconds that took, and the children still alive 15 s after."""
    pid = ray.get(engine.__ray_call__.remote(lambda _worker: os.getpid()))
    children = psutil.Process(pid).children(recursive=True)
    os.kill(pid, signal.SIGKILL)
    killed = time.perf_counter()
    try:
        ray.get(engine.__ray_call__.remote(lambda _worker: None), timeout=DEATH_HANG_GUARD_S)
        ended = "an answer"
    except ray.exceptions.RayActorError as error:
        ended = type(error).__name__
    except ray.exceptions.GetTimeoutError:
        ended = f"the hang guard: neither an answer nor RayActorError in {DEATH_HANG_GUARD_S} s"
    dead_after_s = time.perf_counter() - killed
    _, alive = psutil.wait_procs(children, timeout=15)
    return len(children), ended, dead_after_s, [process.name() for process in alive]


def pool_summary(metrics: dict[str, float]) -> str:
    return ", ".join(f"{key.removeprefix('rollout/')}={value:.2f}" for key, value in sorted(metrics.items()))


@pytest.mark.parametrize("layout", LAYOUTS, ids=["2xTP1", "1xTP2"])
def test_engines_and_tp_give_the_trajectories_of_one_engine(runs, layout):
    reference, candidate = runs[REFERENCE], runs[layout][0]
    assert len(candidate) == len(reference) == GROUPS * GROUP_SIZE
    sampled = sum(sum(t.loss_mask) for t in reference)
    assert sampled > GROUPS * GROUP_SIZE  # the trajectories really sampled something
    assert sum(len(t.tool_calls) for t in reference) >= 1  # and went through the tool path
    max_diff = 0.0
    for ref, got in zip(reference, candidate):
        assert (got.example_id, got.group_id, got.sample_index) == (ref.example_id, ref.group_id, ref.sample_index)
        assert got.prompt_ids == ref.prompt_ids
        assert got.response_ids == ref.response_ids
        assert got.loss_mask == ref.loss_mask
        assert len(got.rollout_logprobs) == len(ref.rollout_logprobs)
        max_diff = max([max_diff, *(abs(a - b) for a, b in zip(got.rollout_logprobs, ref.rollout_logprobs))])
    print(f"\n{layout[0]} x TP{layout[1]} vs one engine: {sampled} sampled tokens identical, "
          f"max |rollout logprob diff| = {max_diff:.2e}")
    assert max_diff <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS, ids=["2xTP1", "1xTP2"])
def test_each_group_runs_on_one_engine_and_every_engine_gets_work(runs, layout):
    trajectories, metrics, line, _, _ = runs[layout]
    engines, tp = layout
    for group in range(GROUPS):
        ran_on = {t.engine for t in trajectories if t.group_id == group}
        assert len(ran_on) == 1 and ran_on <= set(range(engines)), (group, ran_on)
    per_engine = [sum(t.engine == e for t in trajectories) for e in range(engines)]
    assert all(count >= GROUP_SIZE for count in per_engine), per_engine  # every engine ran at least one group
    assert [metrics[f"rollout/engine{e}/trajectories"] for e in range(engines)] == per_engine
    for e in range(engines):
        assert metrics[f"rollout/engine{e}/sampled_tokens"] == sum(sum(t.loss_mask) for t in trajectories
                                                                   if t.engine == e)
        assert 0.0 < metrics[f"rollout/engine{e}/busy_fraction"] <= 1.0
    assert metrics["rollout/redispatched_groups"] == 0.0
    assert re.fullmatch(rf"\[rlsearch\] rollout engines: {engines} x TP{tp}; "
                        + ", ".join(rf"engine {e} on node \w{{8}} \([\d.]+\)" for e in range(engines)), line)
    assert all(t.to_json()["engine"] == t.engine for t in trajectories)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["2xTP1", "1xTP2"])
def test_a_killed_engine_is_seen_dead_and_leaves_no_vllm_process(runs, layout):
    children, ended, _, alive = runs[KILLED, layout]
    tp = layout[1]
    assert children >= (1 if tp == 1 else 1 + tp), children  # the EngineCore, and a TP worker per rank beyond TP1
    # the forked EngineCore holds copies of the actor's sockets: Ray sees the actor die only once it has gone too
    assert ended in ("ActorDiedError", "ActorUnavailableError"), ended  # Ray's RayActorError kinds, not the hang guard
    assert alive == [], alive


# ---- the Ray side with stand-in workers (no vLLM) -------------------------------------------------------------

DIE_STEP = 99  # a stand-in with vLLM seed 100 (engine 0) exits mid-generate at this step


def _stand_in_class():
    """Defined in a function: Ray ships it by value to its workers."""

    class StandInWorker:
        def __init__(self, engine_spec, rollout, retriever, retriever_url, seed, tools=None) -> None:
            self.spec, self.seed, self.url = engine_spec, seed, retriever_url
            self.calls = 0

        def generate(self, items, step):
            self.calls += 1
            time.sleep(0.05)
            if step == DIE_STEP and self.spec.seed == 100:
                os._exit(1)
            return [Trajectory(i.example_id, i.group_id, i.sample_index, [self.seed], loss_mask=[1, 1])
                    for i in items]

        def setup(self):
            return self.spec.seed, self.spec.vllm_port, self.seed, self.url, os.getpid()

        def node_id(self):
            return ray.get_runtime_context().get_node_id()

        def idle_seconds(self):
            return 1.0

        def tool_stats(self):
            return {"requests": self.calls, "failures": 0}

        def shutdown(self):
            pass

    return StandInWorker


def test_pool_places_seeds_redispatches_and_restarts(ray_local, tmp_path):
    from ray.util import placement_group_table

    items = [PromptItem(f"q{g}", "q", group_id=g, sample_index=s) for g in range(6) for s in range(2)]
    rollout = RolloutConfig(num_engines=2, groups_per_engine=2)
    tools = ToolsConfig(retriever=RetrieverConfig(url="http://127.0.0.1:9/retrieve"))
    pool = EnginePool(EngineSpec("unused", seed=100), rollout, tools, SEED, worker_cls=_stand_in_class())
    try:
        table = placement_group_table(pool.placement_group)
        assert table["state"] == "CREATED" and list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        setups = ray.get([engine.setup.remote() for engine in pool.engines])
        assert [s[0] for s in setups] == [100, 101]  # vLLM seeds differ
        assert setups[1][1] - setups[0][1] == 100 and setups[0][1] >= 20000  # disjoint VLLM_PORT windows
        assert {s[2] for s in setups} == {SEED}  # one sampling seed for all
        assert {s[3] for s in setups} == {"http://127.0.0.1:9/retrieve"}
        line, ips = describe_placement("colocated", pool.engines[:1], pool.engines)
        assert re.fullmatch(r"\[rlsearch\] placement colocated: actor ranks 0 on node (\w{8}) \(([\d.]+)\); "
                            r"rollout engines 0-1 on node \1 \(\2\)", line), line
        assert ips == [ips[0]] * 2 and ips[0] == ray.util.get_node_ip_address()
        check_retriever_reachable(tools, ips)  # engines on this node reach its loopback

        trajectories = pool.generate(items, 1)
        metrics = pool.last_metrics()
        groups = [metrics[f"rollout/engine{e}/groups"] for e in (0, 1)]
        assert sum(groups) == 6 and min(groups) >= 2, groups  # the first deal gives each engine 2 groups
        assert [metrics[f"rollout/engine{e}/sampled_tokens"] for e in (0, 1)] == [4 * g for g in groups]
        assert metrics["rollout/redispatched_groups"] == 0.0
        assert pool.tool_stats() == {"requests": 6, "failures": 0} and pool.idle_seconds() == 1.0

        trajectories = pool.generate(items, DIE_STEP)  # engine 0 exits in its first group
        metrics = pool.last_metrics()
        assert [(t.example_id, t.sample_index) for t in trajectories] == [(i.example_id, i.sample_index)
                                                                          for i in items]
        assert {t.engine for t in trajectories} == {1}
        assert metrics["rollout/engine1/groups"] == 6.0 and metrics["rollout/engine0/groups"] == 0.0
        assert metrics["rollout/redispatched_groups"] == 2.0  # the two groups dealt to engine 0
        assert pool.dead_engines() == [0]
        assert pool.tool_stats()["requests"] == groups[1] + 6  # the survivor's calls only

        old_pid = setups[0][4]
        pool.restart(0)
        assert pool.dead_engines() == []
        seed, port, _, _, pid = ray.get(pool.engines[0].setup.remote())
        assert (seed, port) == setups[0][:2] and pid != old_pid
        pool.generate(items, 2)
        assert pool.last_metrics()["rollout/engine0/groups"] >= 2.0  # the new engine 0 gets work

        overlapping = [pool.submit(items, step) for step in (5, 6)]  # rollouts that overlap (async_steps)
        for future in overlapping:
            assert [t.sample_index for t in future.result(timeout=60)] == [i.sample_index for i in items]
        assert [sum(pool.last_metrics(step)[f"rollout/engine{e}/groups"] for e in (0, 1)) for step in (5, 6)] == [6, 6]
        assert pool.last_metrics(1)["rollout/engine0/groups"] == groups[0]  # a recent step's metrics are kept

        # an engine that dies after a rollout (as after a sync) leaves the step's counts to the others, and is known
        # dead (restarted before the next rollout) rather than failing the step
        os.kill(ray.get(pool.engines[1].setup.remote())[4], signal.SIGKILL)
        deadline = time.monotonic() + 60  # Ray sees the process gone within seconds: a ping then fails at once
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(pool.engines[1].__ray_ready__.remote(), timeout=60)
                time.sleep(0.05)
        assert pool.tool_stats() == ray.get(pool.engines[0].tool_stats.remote()) and pool.idle_seconds() == 1.0
        assert pool.live() == [0] and pool.dead_engines() == [1]
    finally:
        group = pool.placement_group
        pool.shutdown()
    assert pool.engines == [] and placement_group_table(group)["state"] == "REMOVED"
