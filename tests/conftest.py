"""Shared fixtures: the embedded default assets (built once per session) and a local Ray instance."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parent.parent


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

    from rlsearch.trainer import init_ray

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


@contextlib.contextmanager
def started_rollout_worker(ray, model_dir: Path, retriever_url: str):
    """A real vLLM engine (Ray actor) with the agent loop over `model_dir`, talking HTTP to the retriever."""
    from rlsearch.config import RetrieverConfig, RolloutConfig
    from rlsearch.rollout import EngineSpec, RolloutWorker

    worker = ray.remote(RolloutWorker).options(num_cpus=0).remote(
        EngineSpec(str(model_dir), max_model_len=768), RolloutConfig(**TEST_ROLLOUT),
        RetrieverConfig(topk=2, max_retries=1, backoff_s=0.05, timeout_s=2.0), retriever_url, 1,
    )
    yield worker
    ray.kill(worker)


@contextlib.contextmanager
def started_actor_group(model_dir: Path):
    """One Megatron rank (gloo, CPU patches) as a Ray actor, initialised from the HF model at `model_dir`."""
    from rlsearch.actor import ActorGroup, ActorWorkerSpec
    from rlsearch.config import ActorConfig, AlgoConfig

    group = ActorGroup(ActorWorkerSpec(
        model_path=str(model_dir), dtype="float32", actor=ActorConfig(lr=1e-4),
        algo=AlgoConfig(), temperature=1.0, total_steps=10, seed=1,
    ))
    yield group
    group.shutdown()


@pytest.fixture(scope="session")
def rollout_worker(ray_local, tiny_model_dir, retriever):
    with started_rollout_worker(ray_local, tiny_model_dir, retriever.url) as worker:
        yield worker


@pytest.fixture(scope="session")
def actor_group(ray_local, tiny_model_dir):
    with started_actor_group(tiny_model_dir) as group:
        yield group
