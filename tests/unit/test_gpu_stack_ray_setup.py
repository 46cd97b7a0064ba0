"""What the driver decides from the Ray cluster, and which of its environment variables every worker gets."""

from __future__ import annotations

from rlsearch.ray_setup import _passthrough_env, cluster_has_gpus


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
    sent = _passthrough_env()
    assert {key: sent.get(key) for key in forwarded} == forwarded
    assert not set(kept_home) & set(sent)
