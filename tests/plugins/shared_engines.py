"""The engines and rank processes tests share: started on first use, released after their last user (SharedEngines),
the lane's pool of started Megatron ranks (RankPool), the training drivers' Ray (driver_ray), and the fixtures that
start them."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT


class RankPool:
    """Started Megatron rank processes (Ray actors) that the in-process actor groups of a lane re-use: a group of n
    ranks takes n idle ones, starting the missing ones, and `reset`s them into its layout (ActorRanks' ``workers``),
    which saves each rank its start: a Ray worker and ~8 s of imports (torch, Megatron, mbridge, transformers). A
    group whose test failed is shut down, not kept. At most MAX_IDLE processes (~0.65 GB each) wait between groups;
    `drain` stops them (`_module_memory` says when)."""

    MAX_IDLE = 4

    def __init__(self) -> None:
        self._idle: list = []

    @contextmanager
    def group(self, spec, ranks_class=None):
        """An ActorRanks (or `ranks_class`: CriticRanks) of `spec` on pooled processes, theirs again after the block."""
        import ray

        from rlsearch.actor import ActorRanks, MegatronActorWorker

        ranks_class = ranks_class or ActorRanks

        size = spec.actor.world_size
        taken, self._idle = self._idle[:size], self._idle[size:]
        start = ray.remote(MegatronActorWorker).options(num_cpus=0)
        taken += [start.remote(spec, rank, size) for rank in range(len(taken), size)]
        try:
            group = ranks_class(spec, workers=taken)
        except BaseException:
            for worker in taken:
                ray.kill(worker)
            raise
        finished = False
        try:
            yield group
            finished = True
        finally:
            if finished:
                self._idle += group.release()
                self._keep(self.MAX_IDLE)
            else:
                group.shutdown(graceful=False)

    def drain(self) -> None:
        self._keep(0)

    def _keep(self, count: int) -> None:
        import ray

        while len(self._idle) > count:
            worker = self._idle.pop()
            if ray.is_initialized():
                ray.kill(worker)


RANK_POOL = RankPool()


class SharedEngines:
    """The engines many modules share (`rollout_worker`, `actor_ranks`, `engine_bench`): each is started on first use
    and released right after the last test that uses it. The modules using them run one after another, so the
    memory-heavy modules (several TP2 engines and a multi-rank actor) never run beside them within CI's 24 GiB."""

    NAMES = ("rollout_worker", "actor_ranks", "engine_bench")
    # released after their last user too, but their users stay where they are: the training drivers' engines
    UNGROUPED = ("driver_ray",)

    def __init__(self) -> None:
        self._held: dict[str, tuple[object, object]] = {}  # name -> (the engine, its release)
        self._last_user: dict[str, str] = {}  # name -> node id of the last test using conftest's fixture

    def get(self, name: str, start):
        """The shared `name`, started by `start() -> (engine, release)` if not running."""
        if name not in self._held:
            self._held[name] = start()
        return self._held[name][0]

    def group_users(self, items: list) -> list:
        """`items` with the modules that use a shared engine moved together (at the first one's place), module order
        kept otherwise; records each engine's last user."""
        modules: dict[object, list] = {}
        for item in items:
            modules.setdefault(item.module, []).append(item)
        users = [module for module, its in modules.items()
                 if any(set(self.uses(item)) - set(self.UNGROUPED) for item in its)]
        ordered, placed = [], False
        for module, its in modules.items():
            if module in users:
                if not placed:
                    ordered += [item for user in users for item in modules[user]]
                    placed = True
            else:
                ordered += its
        self._last_user = {name: item.nodeid for item in ordered for name in self.uses(item)}
        return ordered

    def release_after(self, item) -> None:
        for name, node_id in self._last_user.items():
            if node_id == item.nodeid:
                self._release(name)

    def release_all(self) -> None:
        for name in list(self._held):
            self._release(name)

    def _release(self, name: str) -> None:
        held = self._held.pop(name, None)
        if held is not None:
            held[1]()

    @classmethod
    def uses(cls, item) -> list[str]:
        """The shared engines `item` takes from conftest (a module may define its own fixture of the same name)."""
        definitions = item._fixtureinfo.name2fixturedefs
        return [name for name in cls.NAMES + cls.UNGROUPED if name in definitions
                and definitions[name][-1].func.__module__ == __name__]


SHARED_ENGINES = SharedEngines()



@pytest.hookimpl(trylast=True)  # after the item's own fixtures (search_automaton restores engine_bench's weights)
def pytest_runtest_teardown(item, nextitem):
    SHARED_ENGINES.release_after(item)


def pytest_sessionstart(session):
    from rlsearch.rollout import fork_vllm_processes_in_this_process

    fork_vllm_processes_in_this_process()  # the tests' own engines: ~10 CPU-seconds less a start


def pytest_sessionfinish(session):
    SHARED_ENGINES.release_all()


@pytest.fixture(scope="session")
def rank_pool(ray_local) -> RankPool:
    """The lane's pool of started actor ranks: `with rank_pool.group(spec) as group` (RankPool)."""
    return RANK_POOL


@pytest.fixture(scope="session")
def driver_ray(ray_local) -> dict[str, str]:
    """The environment for training drivers run as subprocesses (`rlsearch train`): they join the session's Ray
    instance as a supervisor's drivers do, instead of starting one each, and leave their rollout engines and actor
    ranks running (detached, in the run namespace), which the next driver of the same engine settings, or of as many
    ranks, takes over instead of starting its own (EnginePool's and ActorRanks' ``detached``). Ray's, the engines'
    and the ranks' start-ups are paid once per settings; what is left is stopped after the last test using this
    (SharedEngines)."""
    from rlsearch.ray_setup import SUPERVISOR_RAY_VARIABLE

    def start():
        return {SUPERVISOR_RAY_VARIABLE: ray_local.get_runtime_context().gcs_address}, stop_what_drivers_left

    return SHARED_ENGINES.get("driver_ray", start)


def stop_what_drivers_left() -> None:
    """Stop the rollout engines and actor ranks that drivers on this lane's Ray (driver_ray) left running."""
    import ray

    if ray.is_initialized():
        from rlsearch.actor import stop_detached_ranks
        from rlsearch.rollout import stop_detached_engines

        stop_detached_engines()
        stop_detached_ranks()

@pytest.fixture(scope="module")
def engine_bench(tiny_model_dir, retriever):
    """A real vLLM engine in this process with the tools, for rollouts at any settings and user agents
    (tests/integration/engine_bench.py); shared (SharedEngines)."""
    from tests.integration.engine_bench import Bench

    def start():
        bench = Bench(Path(tiny_model_dir), retriever.url)
        return bench, bench.close

    return SHARED_ENGINES.get("engine_bench", start)


@pytest.fixture(scope="module")
def search_automaton(engine_bench, tiny_model_dir):
    """`engine_bench` with the tiny model rewired into a policy that searches every turn (`search_automaton_weights`,
    searching " born" greedily); the model's own weights come back after the module."""
    from safetensors.torch import load_file

    from rlsearch.data.tiny_model import search_automaton_weights
    from tests.integration.engine_bench import AUTOMATON_QUERIES

    state = load_file(f"{tiny_model_dir}/model.safetensors")
    engine_bench.load_weights(search_automaton_weights(state, engine_bench.engine.tokenizer, AUTOMATON_QUERIES))
    yield engine_bench
    engine_bench.load_weights(state)


def start_rollout_worker(ray, model_dir, retriever_url: str):
    """A real vLLM engine (Ray actor) with the agent loop, talking HTTP to the real BM25 server."""
    from rlsearch.config import RetrieverConfig, RolloutConfig
    from rlsearch.rollout import EngineSpec, RolloutWorker

    return ray.remote(RolloutWorker).options(num_cpus=0).remote(
        EngineSpec(str(model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=768), RolloutConfig(**TEST_ROLLOUT),
        RetrieverConfig(topk=2, max_retries=1, backoff_s=0.05, timeout_s=2.0), retriever_url, 1,
    )


def start_actor_group(model_dir):
    """One Megatron rank (gloo, CPU patches) as a Ray actor, initialised from the HF model, scoring under
    `start_rollout_worker`'s distribution (temperature 1, TEST_ROLLOUT's logit bias)."""
    from transformers import AutoTokenizer

    from rlsearch.actor import ActorRanks, ActorWorkerSpec, SamplingDistribution
    from rlsearch.config import ActorConfig, AlgoConfig
    from rlsearch.rollout import token_logit_bias

    bias = token_logit_bias(AutoTokenizer.from_pretrained(model_dir), TEST_ROLLOUT["logit_bias"])
    return ActorRanks(ActorWorkerSpec(
        model_path=str(model_dir), dtype="float32", actor=ActorConfig(lr=1e-4),
        algo=AlgoConfig(), sampling=SamplingDistribution(1.0, bias), total_steps=10, seed=1,
    ))


def _kill_if_ray_runs(ray, worker) -> None:
    if ray.is_initialized():  # after the session's last test Ray is already down, and its actors with it
        ray.kill(worker)


def _shut_down_if_ray_runs(ray, group) -> None:
    if ray.is_initialized():
        group.shutdown()


@pytest.fixture(scope="module")
def rollout_worker(ray_local, tiny_model_dir, retriever):
    """`start_rollout_worker` over the session's tiny model; shared (SharedEngines)."""
    def start():
        worker = start_rollout_worker(ray_local, tiny_model_dir, retriever.url)
        return worker, lambda: _kill_if_ray_runs(ray_local, worker)

    return SHARED_ENGINES.get("rollout_worker", start)


@pytest.fixture(scope="module")
def actor_ranks(ray_local, tiny_model_dir):
    """`start_actor_group` over the session's tiny model; shared (SharedEngines)."""
    def start():
        group = start_actor_group(tiny_model_dir)
        return group, lambda: _shut_down_if_ray_runs(ray_local, group)

    return SHARED_ENGINES.get("actor_ranks", start)

