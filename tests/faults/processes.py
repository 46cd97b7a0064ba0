"""The processes of a training run, found by what the run knows of them: a run that joined the test session's Ray
(`driver_ray`) has Ray actors that are the session raylet's children, not its driver's. Actor ranks, and the engines
a run started, write their output to OUTPUT_DIR/logs/<role>-<pid>.log; an engine may also have been taken over from
an earlier run on the session's Ray, so there engines are found by their Ray names in the run namespace."""

from __future__ import annotations

import os
from pathlib import Path

import psutil


def engine_processes() -> dict[str, psutil.Process]:
    """The live rollout engines' worker processes by Ray name (the detached engines of the session's run namespace)."""
    import ray

    from rlsearch.rollout.pool import ENGINE_NAME_PREFIX

    processes = {}
    for name in sorted(ray.util.list_named_actors()):
        if not name.startswith(ENGINE_NAME_PREFIX):
            continue
        try:
            pid = ray.get(ray.get_actor(name).__ray_call__.remote(lambda _worker: os.getpid()), timeout=30)
        except (ValueError, ray.exceptions.RayActorError):
            continue  # dead or gone meanwhile
        processes[name] = psutil.Process(pid)
    return processes


def logged_pids(run_dir: Path, role: str) -> list[int]:
    """The pids that name the logs of the run in `run_dir` of `role` (rollout-engine, actor-rank0, or a pattern:
    actor-rank*), oldest log first; the processes may be gone."""
    logs = sorted((run_dir / "logs").glob(f"{role}-*.log"), key=lambda path: path.stat().st_mtime)
    return [int(log.stem.rsplit("-", 1)[1]) for log in logs]


def logged_processes(run_dir: Path, role: str, actor_class: str) -> list[psutil.Process]:
    """The live processes of the run in `run_dir` that logged as `role` (rollout-engine, actor-rank0, ...), Ray
    actors of `actor_class`, oldest log first."""
    processes = []
    for pid in logged_pids(run_dir, role):
        try:
            process = psutil.Process(pid)
            if actor_class in " ".join(process.cmdline()):
                processes.append(process)
        except psutil.Error:
            continue  # gone
    return processes


def actor_rank_process(run_dir: Path, rank: int = 0, role: str = "actor") -> psutil.Process:
    """The live process of actor rank `rank` (`role` critic: of critic rank `rank`) of the run in `run_dir`."""
    processes = logged_processes(run_dir, f"{role}-rank{rank}", "MegatronActorWorker")
    assert processes, f"no live {role} rank {rank} logs under {run_dir / 'logs'}"
    return processes[-1]
