"""The driver's side of an adapter sync (actor.lora.sync=adapter): the engines serve the base model with vLLM's LoRA
on and get only the policy's adapters, a few MB, where a merged sync sends every weight.

1. each pipeline stage's ranks (data-parallel replica 0) gather their adapters' TP shards to the stage's sender,
   which names the whole factors as PEFT does for the HF model (`rlsearch.weights.export.export_stage_adapters`);
2. the stages' factors go, as one PEFT adapter, through Ray's object store to every engine, which loads it in place
   of the last one while paused (`EngineWeightReceiver.load_adapter`), checks that each of its modules bound to a
   layer, recomputes running requests and empties its prefix cache.
The probe check after it compares the engines' logprobs with the actor's, as after any sync. Waits are bounded by
weights.timeout_s as `WeightSync`'s are."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..megatron.lora import peft_config
from .clock import worst_phases
from .deadline import Deadline
from .sync import SyncStats


class AdapterSync:
    """Syncs ``actor_ranks``'s adapters (rank `rank`, scale `alpha` / `rank`) into engines started with vLLM's LoRA
    on; the same calls as `WeightSync`."""

    def __init__(self, actor_ranks, rank: int, alpha: float, timeout_s: float) -> None:
        self.actor = actor_ranks
        self.rank, self.alpha = rank, alpha
        self.timeout_s = timeout_s

    def sync(self, engines: Sequence, version: int | None = None) -> SyncStats:
        """The actor's adapters into `engines`, which then report them as policy version `version` (None: each
        counts one more)."""
        import ray

        started = time.perf_counter()
        deadline = Deadline(self.timeout_s, engines)
        exporting = [worker.stage_adapters.remote() for stage in self.actor.stage_workers() for worker in stage]
        export_started = time.perf_counter()
        stages = deadline.get(exporting, "exporting the adapters")
        export_s = time.perf_counter() - export_started
        tensors = {name: tensor for stage in stages for name, tensor in stage.items()}
        shipped = ray.put(tensors)
        config = peft_config(self.rank, self.alpha, tensors)
        loading = [engine.load_policy_adapter.remote(shipped, config, version) for engine in engines]
        phases = worst_phases(deadline.get(loading, "loading the adapter", engines))
        phases["export"] = export_s
        payload = sum(tensor.nbytes for tensor in tensors.values())
        return SyncStats(seconds=time.perf_counter() - started, num_buckets=1, num_tensors=len(tensors),
                         num_bytes=payload, stage_bytes=[sum(t.nbytes for t in stage.values()) for stage in stages
                                                         if stage],
                         num_engines=len(engines), phases=phases, wire_bytes=payload)

    def replace_senders(self, actor_ranks) -> None:
        """New actor ranks send from now on (the old ones died)."""
        self.actor = actor_ranks

    def close(self, engines: Sequence) -> None:
        """Nothing to release: an adapter sync keeps no groups or files between syncs."""
