"""Gathering a stage's shards to its sender: through shared memory where the group's ranks share a host and hold
their weights in host memory, else through the process group's own gather (nccl on GPUs).

On CPU ranks, `dist.gather` over gloo sends each shard through a loopback TCP socket: at the 0.5B shape in bf16 a
TP2 export spent 1.1-1.6 s of 1.4-2.9 s there, for 494 MB. Instead each other rank of the group copies its shard
into one of two files of its own in /dev/shm, mapped by the group's rank 0, and a barrier hands it over: rank 0
merges straight from the mapping while the others copy the next shard into their other file. A rank overwrites
gather i-1's file in gather i+1, past the barrier of gather i, which rank 0 reaches only once it has called gather
i and so is done with gather i-1's views (callers copy what they keep: `gather(..., keep=True)`).

Whether a group uses shared memory is decided once, at its first gather, by all its ranks together: every rank holds
its shard in host memory, gets room for its two files (reserved whole, so that a full /dev/shm shows at once rather
than as a write that kills the rank), and rank 0 reads, through its own mapping of each other rank's files, the
token that rank wrote there (so ranks on different hosts, or containers with separate /dev/shm, fall back to the
process group). The files are named by pid and removed on `close`, or, after a kill, by the next gather opened on
the host.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..lifetime import files_of_gone_owners, owned_file_name
from .shm import STAGING_DIR, reserved_mapping

SHARD_FILE_PREFIX = "rlsearch-shard-"  # + host-pid-index: a rank's shard files (`ShardGather`)
FILES_PER_RANK = 2  # a rank copies one shard while rank 0 merges the one before
_TOKEN_BYTES = 32


def _uint8_view(mapping: np.memmap, tensor_like: torch.Tensor) -> torch.Tensor:
    """The first bytes of `mapping` as a tensor of `tensor_like`'s dtype and shape."""
    return torch.from_numpy(mapping[:tensor_like.nbytes]).view(tensor_like.dtype).view(tensor_like.shape)


class ShardGather:
    """Gathers one tensor of every rank of `group` (all of equal shape and dtype) to its rank 0, call after call,
    every rank calling in the same order; `largest_bytes`, the largest tensor any call will gather, sizes the files.
    A collective, as `dist.gather`."""

    def __init__(self, group: dist.ProcessGroup, largest_bytes: int) -> None:
        self.group = group
        self.largest_bytes = largest_bytes
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.shared_memory: bool | None = None  # decided at the first gather
        self._own_files: list[tuple[str, np.memmap]] = []  # (path, mapping): this rank's, rank 0 has none
        self._peer_files: list[list[np.memmap]] = []  # on rank 0: each other rank's mappings
        self._calls = 0

    def gather(self, tensor: torch.Tensor, keep: bool = False) -> list[torch.Tensor] | None:
        """Every rank's `tensor`, in group rank order, on rank 0 (None elsewhere). Rank 0's own entry is `tensor`;
        the others stay valid until the next call unless `keep`."""
        if self.shared_memory is None:
            self.shared_memory = self._agree(tensor)
        tensor = tensor.contiguous()
        if not self.shared_memory:
            shards = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(tensor, shards, group_dst=0, group=self.group)
            return shards
        if tensor.nbytes > self.largest_bytes:
            raise ValueError(f"a shard of {tensor.nbytes} bytes is larger than the {self.largest_bytes} this gather "
                             "was sized for")
        slot = self._calls % FILES_PER_RANK
        self._calls += 1
        if self.rank != 0:
            _uint8_view(self._own_files[slot][1], tensor).copy_(tensor)
        dist.barrier(group=self.group)
        if self.rank != 0:
            return None
        peers = [_uint8_view(files[slot], tensor) for files in self._peer_files]
        return [tensor, *(peer.clone() if keep else peer for peer in peers)]

    def close(self) -> None:
        self._peer_files.clear()
        while self._own_files:
            path, _ = self._own_files.pop()
            Path(path).unlink(missing_ok=True)

    def _agree(self, tensor: torch.Tensor) -> bool:
        """Whether the group gathers through shared memory; every rank learns rank 0's decision."""
        own: dict = {"on_host": tensor.device.type == "cpu", "paths": [], "token": uuid.uuid4().hex}
        if self.rank != 0 and own["on_host"]:
            for path in files_of_gone_owners(Path(STAGING_DIR), SHARD_FILE_PREFIX):
                path.unlink(missing_ok=True)
            try:
                for index in range(FILES_PER_RANK):
                    self._own_files.append(self._reserved_file(index, own["token"]))
                    own["paths"].append(self._own_files[-1][0])
            except OSError:  # no room in /dev/shm (a container's 64 MB): the process group's gather instead
                self.close()
                own["paths"] = []
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, own, group=self.group)
        decision = [self.rank == 0 and own["on_host"] and self._can_map(everyone[1:])]
        dist.broadcast_object_list(decision, group_src=0, group=self.group)
        if not decision[0]:
            self.close()
        return decision[0]

    def _reserved_file(self, index: int, token: str) -> tuple[str, np.memmap]:
        """A new file of this rank's, its pages reserved (writing a mapped page past a full tmpfs would kill the
        rank: SIGBUS), mapped, `token` in its first bytes. OSError when /dev/shm has no room for it."""
        path = os.path.join(STAGING_DIR, owned_file_name(SHARD_FILE_PREFIX, index))
        mapping = reserved_mapping(path, max(self.largest_bytes, _TOKEN_BYTES))
        mapping[:_TOKEN_BYTES] = np.frombuffer(token.encode(), dtype=np.uint8)
        return path, mapping

    def _can_map(self, peers: list[dict]) -> bool:
        """On rank 0: map every other rank's files and read back its token."""
        for peer in peers:
            if not peer["paths"]:
                return False
            files = []
            for path in peer["paths"]:
                if not os.path.exists(path):
                    return False
                mapping = np.memmap(path, dtype=np.uint8, mode="r+")
                if mapping.size < self.largest_bytes or bytes(mapping[:_TOKEN_BYTES]) != peer["token"].encode():
                    return False
                files.append(mapping)
            self._peer_files.append(files)
        return True


class ShardGathers:
    """A rank's `ShardGather` of each of its groups (by name: tensor-, expert-parallel), opened at the first export
    that needs it and kept, with its files, for the rank's life."""

    def __init__(self) -> None:
        self._gathers: dict[str, ShardGather] = {}

    def of(self, name: str, group: dist.ProcessGroup, largest_bytes: int) -> ShardGather:
        gather = self._gathers.get(name)
        if gather is None:
            gather = self._gathers[name] = ShardGather(group, largest_bytes)
        return gather

    def close(self) -> None:
        while self._gathers:
            self._gathers.popitem()[1].close()
