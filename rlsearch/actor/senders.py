"""The actor rank's side of the weight transports: one sender per transport, as rlsearch.weights has the engines'
side (receiver.py) and the driver's (`ShmTransport`, `BroadcastTransport`). A rank's worker holds one of each and
hands it its pipeline stage's HF-named tensors (`rlsearch.weights.export.export_stage_weights`) to send.

- `ShmSender`: the shm transport (rlsearch.weights.shm). The stage's sender yields the buckets, as files it writes
  in /dev/shm for engines on its node or as object-store buckets, delta-encoded under weights.delta; its TP and EP
  peers take part in the gathers and yield nothing.
- `BroadcastSender`: the broadcast transport (rlsearch.weights.broadcast). The stage's sender is rank 0 of a
  torch.distributed group with every engine worker and broadcasts bucket after bucket into it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from ..megatron.lora import is_adapter
from ..weights import broadcast, shm
from ..weights.bucket import WeightBucket
from ..weights.clock import PhaseClock
from ..weights.delta import DeltaBucket, DeltaEncoder
from ..weights.process_group import destroy_weight_group, new_weight_group

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def take_part(named_tensors: NamedTensors) -> None:
    """A stage peer's part in an export: it runs the gathers to the stage's sender and sends nothing itself."""
    for _ in named_tensors:
        pass


def export_bytes(chunks: Sequence[torch.nn.Module], in_sender_replica: bool, is_stage_sender: bool) -> int:
    """Bytes the weight path exports from a rank's model `chunks`: its TP shards (in the sender's data-parallel
    replica) and experts, and, on the stage's sender, the tensors every TP rank holds whole."""
    total = 0
    for chunk in chunks:
        for parameter in chunk.parameters():
            if is_adapter(parameter):  # folded into its layer's weight (LoRA), not sent itself
                continue
            expert = not getattr(parameter, "allreduce", True)  # megatron's mark of an expert parameter
            sharded = in_sender_replica and getattr(parameter, "tensor_model_parallel", False)
            if expert or sharded or is_stage_sender:
                total += parameter.numel() * parameter.element_size()
    return total


class ShmSender:
    """A rank's sender of the shm transport: on the stage's sender, its bucket files in /dev/shm (kept from sync to
    sync), what it last sent under weights.delta, and the phase seconds of its last export."""

    def __init__(self) -> None:
        self.delta_encoder = DeltaEncoder()
        self.staged = shm.StagedBuckets()
        self.clock = PhaseClock()

    def buckets(self, named_tensors: NamedTensors, plan: shm.ExportPlan, is_sender: bool,
                ) -> Iterator[WeightBucket | DeltaBucket | dict]:
        """The stage's weights in buckets as `plan` says, yielded by the stage's sender (`is_sender`); a peer only
        iterates `named_tensors` (its part in the gathers) and yields nothing."""
        staged = encoder = None
        if plan.stage_in_shared_memory and is_sender:
            staged = self.staged
            staged.start(keep_all=plan.keep_staged)
        if plan.sync_id is not None and is_sender:
            encoder = self.delta_encoder
            encoder.start(plan.delta_of)
        self.clock = PhaseClock()
        yield from shm.stream_buckets(named_tensors, plan, is_sender, staged, encoder, self.clock)

    @property
    def delta_base_id(self) -> str | None:
        """The sync id of the weights last sent under weights.delta (None: none kept)."""
        return self.delta_encoder.base_id

    def phases(self) -> dict[str, float]:
        """Seconds per phase of the last `buckets` (rlsearch.weights.clock)."""
        return dict(self.clock.seconds)

    def close(self) -> None:
        self.staged.close()


class BroadcastSender:
    """A stage sender's side of the broadcast transport: its place as rank 0 of the stage's broadcast group."""

    def __init__(self) -> None:
        self.group = None  # the stage's group while the rank is in one

    def join(self, address: str, world_size: int, stage: int, timeout_s: float) -> None:
        """Rank 0 of stage `stage`'s group with every engine worker, at `address` (replacing the group it was in)."""
        self.leave()
        self.group = new_weight_group(address, world_size, 0, f"rlsearch-weights-{stage}", timeout_s)

    def leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            destroy_weight_group(group)

    def send(self, named_tensors: NamedTensors, stage: int, engines: list, bucket_bytes: int,
             timeout_s: float) -> dict[str, int]:
        """The stage's weights broadcast into every engine: the buckets, tensors and bytes sent and the phase
        seconds (`rlsearch.weights.broadcast.broadcast_buckets`)."""
        return broadcast.broadcast_buckets(named_tensors, self.group, stage, engines, bucket_bytes, timeout_s)
