"""Weight bridge: trained Megatron weights (TP/PP shards -> HF names, in buckets) into every rollout engine."""

from .sync import SyncStats, logprob_mismatch, sync_weights

__all__ = ["SyncStats", "logprob_mismatch", "sync_weights"]
