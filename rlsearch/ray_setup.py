"""Start (or join) Ray.

A local instance is this process's own: its node address is 127.0.0.1, it has no dashboard, and Ray's token auth
is off for it (unless RAY_AUTH_MODE is set). Ray 2.x binds its core gRPC ports on all interfaces whatever the node
address, so on a host shared with untrusted users set RAY_AUTH_MODE=token before training (Ray then takes its token
from RAY_AUTH_TOKEN, or creates ~/.ray/auth_token). Joining a cluster (``address``) leaves Ray's auth settings as the
environment has them: the cluster decides.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

# set by the supervisor of `rlsearch train --restarts` for its drivers: the address of the Ray instance it started,
# which outlives each driver, and with it the rollout engines and actor ranks (detached actors a restarted driver
# adopts)
SUPERVISOR_RAY_VARIABLE = "RLSEARCH_SUPERVISOR_RAY"
# the Ray namespace of a supervised run's drivers, where their engines' names live (default RUN_NAMESPACE): drivers
# that share one (one after another) take over each other's engines; drivers running side by side need one each
NAMESPACE_VARIABLE = "RLSEARCH_RAY_NAMESPACE"
RUN_NAMESPACE = "rlsearch-run"
NAME_RELEASE_S = 30.0  # for Ray to release the name of a killed detached actor

Started = TypeVar("Started")

WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def init_ray(address: str = "", num_cpus: int = 0) -> bool:
    """Join the cluster at `address`, or start a local instance with at least `num_cpus` logical CPUs (Megatron
    ranks reserve one each in their placement group, rollout engines their tensor_parallel_size each; threads per
    rank are set separately). False: Ray was already initialised, and this call changed nothing."""
    # before importing ray: it reads some of these at import
    for key, value in ray_env_defaults(address).items():
        os.environ.setdefault(key, value)
    import ray

    from .runlog import process_log_dir

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": {**WORKER_ENV, **worker_environment()}}
    # quiet (the default): workers write their output into the run's logs dir, not onto this terminal
    log_to_driver = process_log_dir() is None
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=log_to_driver)
        return True
    if supervisor_ray_address():  # the supervisor's local instance, with the settings it started it with
        ray.init(address=supervisor_ray_address(), namespace=run_namespace(), runtime_env=runtime_env,
                 log_to_driver=log_to_driver, configure_logging=True, logging_level="WARNING")
        return True
    # in the supervised drivers' namespace: a supervisor (or a test session) that starts the instance sees the engines
    # its drivers leave there
    ray.init(
        _node_ip_address="127.0.0.1", num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
        namespace=run_namespace(),
        runtime_env=runtime_env, log_to_driver=log_to_driver, configure_logging=True, logging_level="WARNING",
    )
    return True


def supervisor_ray_address() -> str:
    """The Ray instance of this driver's supervisor (empty: none). The rollout engines outlive a driver there."""
    return os.environ.get(SUPERVISOR_RAY_VARIABLE, "")


def run_namespace() -> str:
    """The Ray namespace of a supervised driver (its engines are named there)."""
    return os.environ.get(NAMESPACE_VARIABLE) or RUN_NAMESPACE


def ray_cpus(actor_world_size: int, num_engines: int, engine_tp: int) -> int:
    """The logical CPUs a local Ray instance needs for a run: one per Megatron rank, and per engine one per TP rank."""
    return actor_world_size + num_engines * engine_tp


def ray_env_defaults(address: str) -> dict[str, str]:
    """The variables ``init_ray`` sets where unset, for the local instance it starts only: auth disabled, no task
    events and no prestarted workers. Ray's GCS keeps the events of the last 100,000 tasks for its dashboard (which a
    local instance does not start), about 3.7 KiB each here: up to ~370 MiB over a long run's actor calls. Ray starts
    a worker process per core at start-up, to have one ready for a task; every actor of a run has the run's
    runtime_env, which a prestarted worker lacks, so each was a process (0.45 CPU-seconds, 79 MB here) that no actor
    used and that stayed for the instance's life. A cluster keeps its settings."""
    defaults = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    if not address:
        defaults["RAY_AUTH_MODE"] = "disabled"
        defaults["RAY_task_events_report_interval_ms"] = "0"
        defaults["RAY_enable_worker_prestart"] = "0"
        defaults["RAY_prestart_worker_first_driver"] = "0"
    return defaults


# sent to every worker (see worker_environment). Not CUDA_*: CUDA_VISIBLE_DEVICES is Ray's to set per worker, and
# CUDA_HOME / CUDA_PATH name directories of this machine; the two CUDA settings that change how a run computes are
# named one by one
PASSTHROUGH_PREFIXES = ("VLLM_", "RLSEARCH_", "NCCL_", "TORCH_NCCL_", "NVTE_")
PASSTHROUGH_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS",
                     "CUDA_LAUNCH_BLOCKING")


def worker_environment() -> dict[str, str]:
    """Sent to every worker (needed when joining a cluster, whose workers do not inherit this environment): the
    VLLM_* settings, the RLSEARCH_* variables (the default tool-server token variables among them), and the NCCL,
    Transformer Engine and CUDA-allocator settings, which every rank of a communicator must share."""
    return {
        key: value for key, value in os.environ.items()
        if key.startswith(PASSTHROUGH_PREFIXES) or key in PASSTHROUGH_NAMES
    }


def take_worker_environment(environment: dict[str, str]) -> None:
    """In a worker a new driver takes over: the variables `worker_environment` sends become the new driver's
    (`environment`, its `worker_environment()`): its logs dir among them. Those it does not set are removed."""
    for key in worker_environment().keys() - environment.keys():
        del os.environ[key]
    os.environ.update(environment)


def start_named_actor(start: Callable[[], Started]) -> Started:
    """`start()`, which makes a named (detached) actor, tried again for up to NAME_RELEASE_S while Ray still holds
    the name for the killed actor it replaces."""
    deadline = time.monotonic() + NAME_RELEASE_S
    while True:
        try:
            return start()
        except ValueError as error:  # "The name ... is already taken"
            if time.monotonic() > deadline:
                raise
            print(f"[rlsearch] waiting for Ray to release the name of a stopped actor ({error})", flush=True)
            time.sleep(0.5)


def stop_named_actors(actor_prefix: str, group_prefix: str, keep: Collection[str] = frozenset()) -> int:
    """Stop the named actors of this Ray namespace whose names start with `actor_prefix`, and free the placement
    groups named with `group_prefix`, but those named in `keep`; returns how many actors were stopped."""
    import ray

    stopped = 0
    for name in ray.util.list_named_actors():
        if name.startswith(actor_prefix) and name not in keep:
            try:
                ray.kill(ray.get_actor(name), no_restart=True)
                stopped += 1
            except ValueError:  # gone meanwhile
                pass
    for group in ray.util.placement_group_table().values():
        name = group.get("name", "")
        if name.startswith(group_prefix) and name not in keep and group["state"] != "REMOVED":
            try:  # named groups are looked up in this namespace: another namespace's group is not ours to free
                ray.util.remove_placement_group(ray.util.get_placement_group(name))
            except ValueError:
                pass
    return stopped


def cluster_has_gpus(resources: dict[str, float] | None = None) -> bool:
    """Whether the Ray cluster (``resources``: its `ray.cluster_resources()`, read when not given) has GPUs. The driver
    decides GPU use from this, never from its own devices: it may run on a CPU-only head node."""
    if resources is None:
        import ray

        resources = ray.cluster_resources()
    return resources.get("GPU", 0) > 0


class NoAnswer(enum.Enum):
    """What `ask_actors` gives for an actor whose process is gone, or that did not answer in time (busy or hung)."""
    DEAD = "dead"
    SILENT = "silent"


# an actor Ray cannot reach for the moment (ActorUnavailableError: a dropped connection, a restart under way) is asked
# again this many times, after a backoff that doubles from UNAVAILABLE_BACKOFF_S, before it is taken for dead
UNAVAILABLE_RETRIES = 3
UNAVAILABLE_BACKOFF_S = 0.5


def ask_actors(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[Any]:
    """What each call (e.g. ``handle.method.remote``, issued here) answers within ``timeout_s``; NoAnswer.DEAD where its
    actor's process is gone (a call to it fails at once; one that Ray's memory monitor killed fails with
    OutOfMemoryError, not an actor error), or unreachable each time it was asked (`UNAVAILABLE_RETRIES`);
    NoAnswer.SILENT where no answer came in time, which is not known death."""
    import ray

    answers: list[Any] = [NoAnswer.SILENT] * len(calls)
    deadline = time.monotonic() + timeout_s
    asking = list(range(len(calls)))
    for retry in range(UNAVAILABLE_RETRIES + 1):
        if not asking:
            break
        if retry:
            time.sleep(UNAVAILABLE_BACKOFF_S * 2 ** (retry - 1))
        refs = [calls[index]() for index in asking]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        answered = set(ready)
        unavailable = []
        for index, ref in zip(asking, refs):
            if ref not in answered:
                answers[index] = NoAnswer.SILENT
                continue
            try:
                answers[index] = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                answers[index] = NoAnswer.DEAD  # unless a retry reaches it (or finds it silent)
                unavailable.append(index)
            except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError):
                answers[index] = NoAnswer.DEAD
        asking = unavailable
    return answers


def actor_states(handles: list, timeout_s: float) -> list[str]:
    """Per Ray actor handle: "live" (it answered a ping), "dead" or "silent" (`ask_actors`)."""
    answers = ask_actors([handle.__ray_ready__.remote for handle in handles], timeout_s)
    return [answer.value if isinstance(answer, NoAnswer) else "live" for answer in answers]
