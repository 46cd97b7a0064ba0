"""Shared fixtures: the embedded default assets (built once per session) and a local Ray instance."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from rlsearch.megatron.processes import stop_rank_server
from tests.models import model_override, shared_test_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent
# The training runs of the random-init model (tests/e2e, tests/faults, test_multinode): its turns mostly run to the
# token limit, and 24 tokens a turn instead of the tiny config's 48 take a step from 4.5 s to 2.5 s here (rollout,
# logprobs and training all scale with the sampled tokens) while every step still has searches, invalid calls and
# truncations
SHORT_TURNS = "rollout.max_tokens_per_turn=24"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu, run by scripts/gpu_check.sh); skipped "
                            "without one")
    config.addinivalue_line("markers", "memory_heavy: holds several GiB of engines and ranks at once (a module's "
                            "pytestmark, or a test's): never beside another such module or test in the other lane")
    if not config.pluginmanager.hasplugin("xdist"):  # RLSEARCH_TEST_LANES=1: the lanes' marks are left unread
        config.addinivalue_line("markers", "xdist_group(name): the lane a test runs in (pytest-xdist)")


def pytest_itemcollected(item):
    """Each test's lane group, as it is collected: pytest-xdist reads the groups into the tests' ids in its own
    pytest_collection_modifyitems, before ours."""
    item.add_marker(pytest.mark.xdist_group(_lane_group(item)[1]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: RLSEARCH_TEST_LANES=1 runs without it
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadgroup scheduling with the groups taken in the order of the tests (the longest first, as
    pytest_collection_modifyitems puts them), where xdist takes the groups with the most tests first."""
    from xdist.scheduler import LoadGroupScheduling

    class InTestOrder(LoadGroupScheduling):
        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_in_test_order", False):  # the queue is complete on the first assignment
                first_test = {scope: index for index, scope in enumerate(dict.fromkeys(
                    self._split_scope(nodeid) for nodeid in self.collection))}
                for scope in sorted(self.workqueue, key=first_test.__getitem__):
                    self.workqueue.move_to_end(scope)
                self._in_test_order = True
            super()._assign_work_unit(node)

    return InTestOrder(config, log) if config.getvalue("dist") == "loadgroup" else None


# The hang guard of a test that uses these fixtures (pytest-timeout; scripts/test.sh sets the default, TEST_TIMEOUT_S):
# the README's default run (SFT and 30 steps of the real-vocabulary model) took 968 s on the slowest CPU seen
LONG_FIXTURE_TIMEOUT_S = {"default_run": 2400}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the run order below is the final one
def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    for item in items:
        for fixture, seconds in LONG_FIXTURE_TIMEOUT_S.items():
            if fixture in item.fixturenames and not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(seconds))
    items[:] = sorted(SHARED_ENGINES.group_users(items), key=lambda item: _lane_group(item)[0])  # stable sort


# `bash scripts/test.sh` runs the suite in two lanes side by side (pytest-xdist: -n 2 --dist loadgroup), each a worker
# process with session fixtures of its own. A lane takes a group of tests at a time, the next one when it is almost
# done: first the two long groups (the training drivers run as subprocesses on the lane's Ray, driver_ray, taking its
# engines over; the tests of the engines and ranks shared in-process, SharedEngines), then every other module, and
# every bench's smoke run, on its own, the longest first. A training run alone keeps about 1.3 of 2 cores busy.
# (The memory-heavy modules and tests as one group of their own ran beside the drivers' heaviest runs and made the
# suite slower, not faster; the lanes' waits for the memory lock are printed after the run.)
DRIVER_TESTS = ("tests/e2e/", "tests/faults/", "tests/integration/test_multinode.py")
BENCH_SMOKE = "tests/integration/test_bench_smoke.py"
LONG_BENCH_SMOKES = ("chaos", "learning", "long_sequences", "soak")  # 1-4 minutes each; the others <1

@pytest.fixture(scope="module", autouse=True)
def _module_memory(request):
    """A module marked memory_heavy (its pytestmark) holds the lanes' memory lock from its first test to its last.
    The lane's idle pooled ranks are stopped before it and before any module that does not use them: they wait only
    among the groups of one module, or of modules that use the pool one after another. The lane's rank server
    (rlsearch.megatron.processes: ~0.6 GB) is stopped before it too, and after each module of the drivers, whose lane
    runs beside the memory-heavy modules without the lock (test_train_resume's conversion starts one)."""
    heavy = _module_memory_heavy(request.module)
    if heavy:
        stop_rank_server()
    if heavy or not any("rank_pool" in item.fixturenames for item in request.session.items
                        if item.module is request.module):
        RANK_POOL.drain()
    with MEMORY_LOCK.held(request.module.__name__) if heavy else nullcontext():
        yield
    if request.node.nodeid.startswith(DRIVER_TESTS):
        stop_rank_server()


@pytest.fixture(autouse=True)
def _memory_heavy_test(request):
    """A test marked memory_heavy holds the lanes' memory lock while it runs."""
    marked = request.node.get_closest_marker("memory_heavy") is not None and not _module_memory_heavy(request.module)
    if marked:
        RANK_POOL.drain()
        stop_rank_server()
    with MEMORY_LOCK.held(request.node.nodeid) if marked else nullcontext():
        yield


def _module_memory_heavy(module) -> bool:
    marks = getattr(module, "pytestmark", [])
    return any(mark.name == "memory_heavy" for mark in (marks if isinstance(marks, list) else [marks]))


class MemoryLock:
    """An exclusive lock (flock) the two lanes share: the modules and tests that hold several GiB at once (2 x TP2
    engines, MoE engines beside expert-parallel ranks) take it, so that two of them never run side by side within
    CI's 24 GiB. Within one lane it is free: a lane runs one test at a time."""

    def __init__(self) -> None:
        checkout = hashlib.sha1(str(REPO_ROOT).encode()).hexdigest()[:8]  # lanes of one suite, not another checkout's
        self.path = Path(tempfile.gettempdir()) / f"rlsearch-tests-{checkout}.lock"
        self.waits = self.path.with_suffix(".waits")  # "seconds holder" per wait of a second or more

    @contextmanager
    def held(self, holder: str):
        with self.path.open("a") as handle:
            asked = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = time.monotonic() - asked
            if waited >= 1.0:
                with self.waits.open("a") as record:
                    record.write(f"{waited:.0f} {holder}\n")
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def summary(self) -> str | None:
        """The lanes' waits for the lock in this run, in a line (None without any)."""
        if not self.waits.exists():
            return None
        waits = [(float(seconds), holder) for seconds, holder in
                 (line.split(" ", 1) for line in self.waits.read_text().splitlines())]
        longest = max(waits)
        return (f"memory lock: the lanes waited {sum(w for w, _ in waits):.0f} s for it, {len(waits)} times; the "
                f"longest {longest[0]:.0f} s, before {longest[1]}")


MEMORY_LOCK = MemoryLock()


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
    def group(self, spec):
        """An ActorRanks of `spec` on pooled processes, theirs again after the block."""
        import ray

        from rlsearch.actor import ActorRanks, MegatronActorWorker

        size = spec.actor.world_size
        taken, self._idle = self._idle[:size], self._idle[size:]
        start = ray.remote(MegatronActorWorker).options(num_cpus=0)
        taken += [start.remote(spec, rank, size) for rank in range(len(taken), size)]
        try:
            group = ActorRanks(spec, workers=taken)
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


def _lane_group(item) -> tuple[int, str]:
    """The group a lane takes `item` in, and the rank of its kind in the order the lanes take groups."""
    module = item.nodeid.split("::")[0]
    if set(SHARED_ENGINES.uses(item)) - set(SharedEngines.UNGROUPED):  # wherever it is: started once, in one lane
        return 1, "shared-engines"
    if item.nodeid.startswith(DRIVER_TESTS):
        return 0, "drivers"
    if module == BENCH_SMOKE:
        long = any(f"[{name}.py]" in item.nodeid for name in LONG_BENCH_SMOKES)
        return (2 if long else 4), "bench-" + item.nodeid.split("[")[-1].split("]")[0]
    return (3 if module.startswith("tests/integration/") else 5), module


def _skip_gpu_tests_without_cuda(items) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: scripts/gpu_check.sh runs these on a GPU machine")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (search_automaton restores engine_bench's weights)
def pytest_runtest_teardown(item, nextitem):
    SHARED_ENGINES.release_after(item)


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the run itself, not one of its lanes
        MEMORY_LOCK.waits.unlink(missing_ok=True)
    from rlsearch.rollout import fork_vllm_processes_in_this_process

    fork_vllm_processes_in_this_process()  # the tests' own engines: ~10 CPU-seconds less a start


def pytest_runtest_logreport(report):
    """Records the skips of tests that do not need a GPU (in the run itself: the lanes' reports come to it)."""
    if report.skipped and "gpu" not in report.keywords:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        UNEXPECTED_SKIPS.append(f"{report.nodeid}: {reason}")


UNEXPECTED_SKIPS: list[str] = []


def pytest_sessionfinish(session):
    SHARED_ENGINES.release_all()
    if UNEXPECTED_SKIPS and not hasattr(session.config, "workerinput") and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a skip that hides a missing tool or right is a failure


def pytest_terminal_summary(terminalreporter):
    line = MEMORY_LOCK.summary()
    if line:
        terminalreporter.write_line(line)
    if UNEXPECTED_SKIPS:
        terminalreporter.write_line(f"{len(UNEXPECTED_SKIPS)} tests skipped that need no GPU, so the run fails (only "
                                    "tests marked gpu may skip): " + "; ".join(UNEXPECTED_SKIPS), red=True)


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


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """`bash examples/run_search_grpo.sh` as the README gives it, run once per session by bench/default_run.py (one
    seed, no control: the script with the output dir, the warm start's dir and the seeds, 1 as by default, named),
    which then reads the run's TensorBoard scalars as the bench does: the bench's smoke run besides (a run of its own
    before 2026-11-29, 115 s of the suite). The SFT warm start is made here every session, as on a fresh clone, then
    the 30 GRPO steps. (run dir, CompletedProcess of the run: its terminal output as stdout, stderr empty, the
    bench's output). It starts a Ray of its own: the engines and ranks the lane's earlier drivers left running on
    driver_ray (~4.7 GB idle after the async TP2PP2 run) are stopped first. Beside them and the other lane's
    memory-heavy parity module the suite used 22.5 of 24.1 GB here, and crossed Ray's memory monitor's 95% on CI,
    which killed a rank in each lane."""
    import subprocess

    stop_what_drivers_left()
    root = tmp_path_factory.mktemp("default_run")
    env = {key: value for key, value in os.environ.items() if key != "RLSEARCH_VERBOSE"}
    bench = subprocess.run([sys.executable, "bench/default_run.py", "--seeds", "1", "--no-control", "--out", str(root)],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500, env=env)
    run = root / "seed_1" / "learn"
    terminal = run.with_suffix(".log")
    assert bench.returncode == 0, (terminal.read_text()[-3000:] if terminal.is_file() else "") + bench.stdout[-3000:] \
        + bench.stderr[-3000:]
    return run, subprocess.CompletedProcess(bench.args, 0, stdout=terminal.read_text(), stderr=""), bench.stdout


@pytest.fixture(scope="session")
def async_tp2pp2_run(tmp_path_factory, driver_ray):
    """`bash examples/run_search_grpo.sh` (the random-init model) with four Megatron ranks (TP2 x PP2) on gloo and the
    rollout of step 2 overlapping the training of step 1 (rollout.async_steps=1), two updates a step, an eval after
    each step: 2 steps of 2 questions. One run, checked by test_train_e2e (the layout, async, eval) and test_inspect
    (what the trajectories hold). (output dir, CompletedProcess)."""
    import subprocess

    out = tmp_path_factory.mktemp("async_tp2pp2") / "run"
    result = subprocess.run(
        ["bash", "examples/run_search_grpo.sh", "actor.tp=2", "actor.pp=2", "trainer.total_steps=2",
         "data.batch_size=2", "rollout.async_steps=1", "algo.num_minibatches=2", "trainer.eval_interval=1",
         "eval.max_examples=4", SHORT_TURNS, model_override(), f"trainer.output_dir={out}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "RLSEARCH_WARM_START": "none", **driver_ray})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


class ModuleScratch:
    """`tmp_path_factory` for a module's fixtures (models, checkpoints, runs), whose directories go after the module's
    last test unless one of its tests failed, instead of staying to the end of the run: with them kept, a run's
    scratch peaked at 19 GB (a tiny model's checkpoint with Adam's state is 0.44 GB)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._made: list[Path] = []

    def mktemp(self, name: str) -> Path:
        path = self._factory.mktemp(name)
        self._made.append(path)
        return path

    def remove(self) -> None:
        for path in self._made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory) -> ModuleScratch:
    scratch = ModuleScratch(tmp_path_factory)
    failed = request.session.testsfailed
    yield scratch
    if request.session.testsfailed == failed:
        scratch.remove()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tests' tiny Qwen2 (tests/models.py: a small vocabulary), one for both lanes and their drivers."""
    return shared_test_model()


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    from rlsearch.data import make_toy_data

    return make_toy_data(tmp_path_factory.mktemp("toy"), seed=0, num_entities=60)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from rlsearch.ray_setup import init_ray

    init_ray(num_cpus=8)  # logical CPUs: room for the 4-rank layouts' placement groups
    yield ray
    RANK_POOL.drain()
    ray.shutdown()


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


TEST_KV_CACHE_GIB = 0.25  # each test engine's KV cache: plenty for the tiny model, 0.75 GiB of host memory less
TEST_ROLLOUT = {
    "max_turns": 3, "max_response_tokens": 256, "max_tokens_per_turn": 48, "assistant_prefix": "<search>",
    "logit_bias": {"</search>": 12.0},
}


@pytest.fixture(scope="session")
def retriever(toy_data, tmp_path_factory):
    from rlsearch.tools import RetrieverProcess

    process = RetrieverProcess(str(toy_data.corpus), cache_dir=str(tmp_path_factory.mktemp("bm25"))).start()
    yield process
    process.stop()


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

