"""What Ray workers get and decide, on a real local Ray: the forwarded environment, the cluster's GPUs, a worker's
own device, and the /dev/shm check run inside the actors of the nodes that stage weight buckets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.constants import REPO_ROOT

FORWARDED = {
    "NCCL_SOCKET_IFNAME": "lo", "NVTE_DEBUG": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_BLOCKING_WAIT": "1",
}


def test_init_ray_sends_nccl_te_and_allocator_settings_to_every_worker():
    """Workers of a joined cluster get only the runtime environment's variables (local ones would also inherit the
    driver's): the check reads that environment from inside a worker. Ray sets CUDA_VISIBLE_DEVICES per worker, so it
    is never sent. Its own process: the runtime environment is fixed when Ray starts."""
    script = textwrap.dedent("""
        import json, os, ray
        from rlsearch.ray_setup import init_ray

        init_ray(num_cpus=1)

        @ray.remote(num_cpus=0)
        def seen():
            sent = ray.get_runtime_context().runtime_env.get("env_vars", {})
            return {"sent": sent, "environ": {key: os.environ.get(key) for key in sent}}

        print(json.dumps(ray.get(seen.remote())))
        ray.shutdown()
    """)
    env = {**os.environ, **FORWARDED, "CUDA_VISIBLE_DEVICES": "", "CUDA_HOME": "/nowhere/cuda"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    worker = json.loads(result.stdout.strip().splitlines()[-1])
    assert {key: worker["sent"].get(key) for key in FORWARDED} == FORWARDED
    assert {key: worker["environ"][key] for key in FORWARDED} == FORWARDED
    assert "CUDA_VISIBLE_DEVICES" not in worker["sent"] and "CUDA_HOME" not in worker["sent"]


def test_gpu_use_comes_from_the_cluster_and_a_worker_given_no_gpu_computes_on_cpu(ray_local, monkeypatch):
    """The local cluster has this machine's GPUs (none here). A stand-in GPU (torch.cuda.is_available patched): the
    driver, outside Ray's assignment, would take its LOCAL_RANK GPU; a Ray worker Ray gave no GPU takes none, though
    it sees one."""
    import torch

    from rlsearch import devices
    from rlsearch.ray_setup import cluster_has_gpus

    assert cluster_has_gpus() is (torch.cuda.device_count() > 0)

    @ray_local.remote(num_cpus=0, num_gpus=0, max_calls=1)  # the patched worker process exits after the call
    def worker_device() -> tuple[list, int | None, str]:
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        return ray_local.get_gpu_ids(), devices.local_gpu_index(), devices.process_group_backend()

    assert ray_local.get(worker_device.remote()) == ([], None, "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert devices.local_gpu_index() == 0


def test_the_staging_check_runs_on_the_staging_node_and_names_the_need(ray_local):
    from rlsearch.weights.deadline import Deadline
    from rlsearch.weights.shm import StagingSpaceError, check_staging_room

    class Node:
        """An actor standing for every sender and engine (one node): the check runs inside it."""

        def node_id(self) -> str:
            return ray_local.get_runtime_context().get_node_id()

    node = ray_local.remote(Node).options(num_cpus=0).remote()
    deadline = Deadline(60.0, [node, node])
    check_staging_room([[node]], [node, node], 2**20, deadline, same_node=True)  # this node has room for 4 MiB
    huge = 64 * 2**30  # more than this machine's /dev/shm holds
    with pytest.raises(StagingSpaceError, match=r"but 2 sender\(s\) x 4 staged buckets x 65536 MiB "
                       r"\(weights\.bucket_mb\) need 512\.00 GiB") as raised:
        check_staging_room([[node], [node]], [node, node], huge, deadline, same_node=True)
    assert "weights.transport=broadcast" in str(raised.value)
    assert "Traceback" not in str(raised.value)  # the actor's error, unwrapped
    with pytest.raises(StagingSpaceError, match=r"but 2 engine\(s\) x 1 staged bucket x 65536 MiB "
                       r"\(weights\.bucket_mb\) need 128\.00 GiB"):
        check_staging_room([[node]], [node, node], huge, deadline, same_node=False)
    ray_local.kill(node)
