"""Shared fixtures: the embedded default assets (built once per session) and a local Ray instance."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu, run by scripts/gpu_check.sh); skipped "
                            "without one")


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: scripts/gpu_check.sh runs these on a GPU machine")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """`bash examples/run_search_grpo.sh` as the README gives it, with only the output dir moved: the SFT warm start
    (made once into outputs/assets) and the 30 GRPO steps, run once per session. (output dir, CompletedProcess)."""
    import subprocess

    out = tmp_path_factory.mktemp("default_run") / "run"
    env = {**os.environ, "RLSEARCH_WARM_START": "sft"}
    env.pop("RLSEARCH_VERBOSE", None)
    result = subprocess.run(["bash", "examples/run_search_grpo.sh", f"trainer.output_dir={out}"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=1500, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rlsearch.data.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("assets") / "tiny-qwen2")


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
    ray.shutdown()


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


@pytest.fixture(scope="session")
def engine_bench(tiny_model_dir, retriever):
    """A real vLLM engine in this process with the tools, for rollouts at any settings and user agents
    (tests/integration/engine_bench.py)."""
    from tests.integration.engine_bench import Bench

    bench = Bench(Path(tiny_model_dir), retriever.url)
    yield bench
    bench.close()


@pytest.fixture(scope="module")
def search_automaton(engine_bench, tiny_model_dir):
    """`engine_bench` with the tiny model rewired into a policy that searches every turn (`search_automaton_weights`,
    searching " inventor" greedily); the model's own weights come back after the module."""
    from safetensors.torch import load_file

    from rlsearch.data.tiny_model import search_automaton_weights
    from tests.integration.engine_bench import AUTOMATON_QUERIES

    state = load_file(f"{tiny_model_dir}/model.safetensors")
    engine_bench.load_weights(search_automaton_weights(state, engine_bench.engine.tokenizer, AUTOMATON_QUERIES))
    yield engine_bench
    engine_bench.load_weights(state)


def engine_and_actor_fixtures(scope: str):
    """The `rollout_worker` and `actor_group` fixtures over `tiny_model_dir`, at `scope`. conftest makes them per
    session; a module that overrides `tiny_model_dir` makes its own per module (a session fixture already built
    would otherwise be reused with the session's model)."""

    @pytest.fixture(scope=scope)
    def rollout_worker(ray_local, tiny_model_dir, retriever):
        """A real vLLM engine (Ray actor) with the agent loop, talking HTTP to the real BM25 server."""
        from rlsearch.config import RetrieverConfig, RolloutConfig
        from rlsearch.rollout import EngineSpec, RolloutWorker

        worker = ray_local.remote(RolloutWorker).options(num_cpus=0).remote(
            EngineSpec(str(tiny_model_dir), max_model_len=768), RolloutConfig(**TEST_ROLLOUT),
            RetrieverConfig(topk=2, max_retries=1, backoff_s=0.05, timeout_s=2.0), retriever.url, 1,
        )
        yield worker
        ray_local.kill(worker)

    @pytest.fixture(scope=scope)
    def actor_group(ray_local, tiny_model_dir):
        """One Megatron rank (gloo, CPU patches) as a Ray actor, initialised from the tiny HF model, scoring under
        `rollout_worker`'s distribution (temperature 1, TEST_ROLLOUT's logit bias)."""
        from transformers import AutoTokenizer

        from rlsearch.actor import ActorGroup, ActorWorkerSpec, SamplingDistribution
        from rlsearch.config import ActorConfig, AlgoConfig
        from rlsearch.rollout import token_logit_bias

        bias = token_logit_bias(AutoTokenizer.from_pretrained(tiny_model_dir), TEST_ROLLOUT["logit_bias"])
        group = ActorGroup(ActorWorkerSpec(
            model_path=str(tiny_model_dir), dtype="float32", actor=ActorConfig(lr=1e-4),
            algo=AlgoConfig(), sampling=SamplingDistribution(1.0, bias), total_steps=10, seed=1,
        ))
        yield group
        group.shutdown()

    return rollout_worker, actor_group


rollout_worker, actor_group = engine_and_actor_fixtures("session")
