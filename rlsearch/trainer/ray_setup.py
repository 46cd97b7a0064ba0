"""Start (or join) Ray. A local instance listens on 127.0.0.1 only, with no dashboard."""

from __future__ import annotations

import os

WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def init_ray(address: str = "", num_cpus: int = 0) -> None:
    """Join the cluster at `address`, or start a local instance with at least `num_cpus` logical CPUs (Megatron
    ranks reserve one each in their placement group; threads per rank are set separately)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    runtime_env = {"env_vars": {**WORKER_ENV, **_passthrough_env()}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(
        _node_ip_address="127.0.0.1", num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
        runtime_env=runtime_env, log_to_driver=True, configure_logging=True, logging_level="WARNING",
    )


def _passthrough_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith(("VLLM_", "RLSEARCH_"))}
