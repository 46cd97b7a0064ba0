"""What the driver decides from the Ray cluster, and which of its environment variables every worker gets."""

from __future__ import annotations

import os
from types import SimpleNamespace
from unittest.mock import patch

import pytest

from rlsearch.ray_setup import cluster_has_gpus, take_worker_environment, worker_environment


def test_gpu_use_is_the_clusters_not_the_drivers():
    assert cluster_has_gpus({"CPU": 64.0, "GPU": 8.0, "memory": 1e12}) is True
    assert cluster_has_gpus({"CPU": 2.0, "memory": 1e10}) is False  # a CPU-only cluster: no GPU key at all
    assert cluster_has_gpus({"CPU": 2.0, "GPU": 0.0}) is False


def test_nccl_te_and_allocator_settings_reach_the_workers_but_not_the_device_mask(monkeypatch):
    forwarded = {
        "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5", "TORCH_NCCL_BLOCKING_WAIT": "1", "NVTE_DEBUG": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_LAUNCH_BLOCKING": "1", "VLLM_PORT": "20000",
        "RLSEARCH_RETRIEVER_TOKEN": "t",
    }
    kept_home = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_HOME": "/usr/local/cuda-13.0", "NCCLX": "1", "HOME": "/root"}
    for key, value in {**forwarded, **kept_home}.items():
        monkeypatch.setenv(key, value)
    sent = worker_environment()
    assert {key: sent.get(key) for key in forwarded} == forwarded
    assert not set(kept_home) & set(sent)


def test_a_worker_taken_over_by_a_new_driver_has_that_drivers_settings_and_keeps_its_own():
    """A detached rank the next driver takes over (ActorRanks' ``detached``): the variables drivers send become the
    new driver's (its logs dir among them); those it does not send go; the process's own stay."""
    with patch.dict(os.environ, {"RLSEARCH_LOG_DIR": "/old/run/logs", "RLSEARCH_FAULT_SETTING": "old",
                                 "NCCL_IB_HCA": "mlx5", "CUDA_VISIBLE_DEVICES": "3", "HOME": "/root"}):
        take_worker_environment({"RLSEARCH_LOG_DIR": "/new/run/logs", "VLLM_PORT": "21000"})
        assert worker_environment() == {"RLSEARCH_LOG_DIR": "/new/run/logs", "VLLM_PORT": "21000"}
        assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["HOME"]) == ("3", "/root")


class _Ref:
    """A Ray object ref that is ready at once: its call's answer, or the error it raised."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome


class _Actor:
    """A Ray actor handle whose calls (any method) give ``outcomes`` in turn, the last one for good."""

    def __init__(self, *outcomes) -> None:
        self.outcomes, self.calls = list(outcomes), 0

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=self._remote)

    def _remote(self) -> _Ref:
        self.calls += 1
        return _Ref(self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0])


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.wait and ray.get over `_Ref`s, no Ray started; no backoff between retries."""
    import ray

    from rlsearch import ray_setup

    def get(ref: _Ref):
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray_setup, "UNAVAILABLE_BACKOFF_S", 0.0)


def _unavailable():
    from ray.exceptions import ActorUnavailableError

    return ActorUnavailableError("the connection to the actor was lost for a moment", None)


def test_a_health_probe_asks_an_unreachable_actor_again_and_only_a_dead_one_is_dead(fake_ray):
    """Ray's ActorUnavailableError is transient (a dropped connection, a restart): the engine (or rank) answers the
    next ask and must not be restarted; ActorDiedError, or unreachable every time, is death."""
    from ray.exceptions import ActorDiedError

    from rlsearch.ray_setup import UNAVAILABLE_RETRIES, actor_states
    from rlsearch.rollout.pool import EnginePool

    flaky, dead, gone = _Actor(_unavailable(), 2.0), _Actor(ActorDiedError()), _Actor(_unavailable())
    assert actor_states([flaky, dead, gone], timeout_s=5.0) == ["live", "dead", "dead"]
    assert (flaky.calls, dead.calls, gone.calls) == (2, 1, 1 + UNAVAILABLE_RETRIES)

    pool = object.__new__(EnginePool)  # its engines' handles alone: nothing started
    pool.engines, pool._dead = [_Actor(_unavailable(), 2.0), _Actor(4.0), _Actor(ActorDiedError())], set()
    assert pool.idle_seconds() == 3.0
    assert pool._dead == {2}
