"""The weight path, a bucket's whole life: rank-local export from the Megatron actor (export.py), the bucket format
(bucket.py), the two transports into the rollout engines (shm.py, broadcast.py, group.py), the engine's end
(receiver.py, vllm_extension.py inside vLLM's workers), the driver's sync (sync.py) and the probe check (probe.py)."""

from .receiver import VLLM_WORKER_EXTENSION, EngineWeightReceiver

__all__ = ["VLLM_WORKER_EXTENSION", "EngineWeightReceiver"]
