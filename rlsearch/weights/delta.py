"""Delta syncs (`weights.delta`): a sender sends only the elements of its tensors that changed since the last sync.

Between two RL steps nearly every bf16 weight is bit-identical (an Adam step of lr 1e-6 moves a weight of 0.02 by
far less than its last bf16 bit). So each stage's sender keeps the HF tensors it sent last (`DeltaEncoder`, on the
tensors' device: a sender on a GPU holds one more copy of its stage's weights there, and compares there) and each
engine's host keeps what it received (`DeltaBase`): a tensor travels either whole ("dense") or as the
positions of its changed elements, gap-coded and zlib-compressed, with their new values ("sparse"), whichever is
smaller. Elements are compared bit by bit, so NaN, -0.0 and every rounding survive exactly.

Both sides name the weights they hold by a sync id. A delta is sent only when the sender and every engine hold the
same id; a restarted engine (it holds none), a sync that failed part-way (both sides drop their id when a sync starts
and take the new one only at its end) or every `weights.delta_full_every`-th sync sends every tensor whole.
A delta bucket carries the checksum of the whole tensors, which the engine's workers verify after the engine host
rebuilt them: a base that drifted is an error, not silently wrong weights.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from .bucket import _MASK64, TensorEntry, WeightBucket, _as_bytes, _entry, _index_crc, _word_sum

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GAP_DTYPES = (np.uint8, np.uint16, np.uint32)


@dataclass
class SparseTensor:
    """The changed elements of one tensor: zlib of their gap-coded positions, and their new values' bytes."""

    count: int
    gap_dtype: str  # numpy dtype name of the gaps before compression
    positions: bytes
    values: np.ndarray  # uint8


@dataclass
class DeltaBucket:
    base_id: str | None  # the sync id of the weights the sparse tensors apply to (None: every tensor dense)
    entries: list[TensorEntry]
    tensors: list[np.ndarray | SparseTensor]  # a dense tensor's bytes (uint8), or its changes
    checksum: tuple[int, int]  # of the whole tensors (`pack_bucket`'s)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the whole tensors."""
        return sum(_entry_bytes(entry) for entry in self.entries)

    @property
    def wire_bytes(self) -> int:
        """Bytes this bucket moves: dense tensors whole, sparse ones as compressed positions and values."""
        return sum(t.nbytes if isinstance(t, np.ndarray) else len(t.positions) + t.values.nbytes for t in self.tensors)


def _entry_bytes(entry: TensorEntry) -> int:
    return int(np.prod(entry.shape, dtype=np.int64)) * torch.empty(0, dtype=getattr(torch, entry.dtype)).element_size()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (flat): equal integers, equal bits."""
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def _encode_positions(positions: np.ndarray) -> tuple[str, bytes]:
    gaps = np.diff(positions, prepend=-1)
    for dtype in _GAP_DTYPES:
        if gaps.size == 0 or int(gaps.max()) <= np.iinfo(dtype).max:
            return np.dtype(dtype).name, zlib.compress(gaps.astype(dtype).tobytes(), 1)
    raise ValueError("a tensor of more than 2**32 elements")


def _decode_positions(sparse: SparseTensor) -> np.ndarray:
    gaps = np.frombuffer(zlib.decompress(sparse.positions), dtype=sparse.gap_dtype).astype(np.int64)
    return np.cumsum(gaps) - 1


class DeltaEncoder:
    """A stage sender's copy of the tensors it sent last, and the sync id of that copy."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}
        self.base_id: str | None = None
        self._delta_of: str | None = None

    def start(self, delta_of: str | None) -> str | None:
        """A sync begins: deltas against `delta_of` if this encoder holds it, else every tensor whole; returns the id
        the deltas apply to (None: dense). The id is dropped until `finish`: a sync that stops part-way leaves none."""
        base_id = delta_of if delta_of is not None and delta_of == self.base_id else None
        self.base_id = None
        self._delta_of = base_id
        return base_id

    def encode(self, named_tensors: list[tuple[str, torch.Tensor]]) -> DeltaBucket:
        """One bucket: each tensor dense or as its changes against the base, and the base updated to it. Tensors are
        compared and checksummed where they are; only what is sent is copied to the host."""
        entries, encoded, words = [], [], 0
        for name, tensor in named_tensors:
            current = tensor.detach().contiguous()
            stored = self.base.get(name)
            same_layout = stored is not None and (stored.shape, stored.dtype, stored.device) == (
                current.shape, current.dtype, current.device)
            entries.append(_entry(name, current))
            words += _word_sum(current.reshape(-1).view(torch.uint8))
            changes = self._changes(stored, current) if same_layout and self._delta_of is not None else None
            encoded.append(changes or _as_bytes(current))
            if same_layout:  # the base keeps its memory sync after sync, whole syncs included
                stored.copy_(current)
            else:
                self.base[name] = current.clone()
        sizes = [_entry_bytes(entry) for entry in entries]
        return DeltaBucket(self._delta_of, entries, encoded, (_index_crc(entries, sizes), words & _MASK64))

    @staticmethod
    def _changes(previous: torch.Tensor, current: torch.Tensor) -> SparseTensor | None:
        """The elements of `current` that differ from `previous` (same shape, dtype and device), or None when sending
        the tensor whole is as small."""
        changed = torch.nonzero(_bits(previous) != _bits(current)).reshape(-1)
        element_size = current.element_size()
        if changed.numel() * (element_size + 1) >= current.numel() * element_size:
            return None
        positions = changed.cpu().numpy()
        gap_dtype, packed = _encode_positions(positions)
        values = _as_bytes(current.reshape(-1)[changed])
        if len(packed) + values.nbytes >= current.numel() * element_size:
            return None
        return SparseTensor(int(positions.size), gap_dtype, packed, values)

    def finish(self, sync_id: str) -> None:
        """Every bucket of the sync was encoded: the base is the weights of `sync_id`."""
        self.base_id = sync_id


class DeltaBase:
    """An engine host's copy of the whole tensors it received last, and the sync id of that copy."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.base_id: str | None = None
        self._held: str | None = None

    def start(self) -> str | None:
        """A sync begins: returns the id of the weights held; it is dropped until `finish` (the base may change
        part-way)."""
        self._held, self.base_id = self.base_id, None
        return self._held

    def apply(self, bucket: DeltaBucket) -> WeightBucket:
        """The bucket's whole tensors (the base updated in place), with the sender's checksum of them."""
        if bucket.base_id is not None and bucket.base_id != self._held:
            raise RuntimeError(f"a delta against weights {bucket.base_id} reached an engine holding {self._held}")
        arrays = []
        for entry, encoded in zip(bucket.entries, bucket.tensors):
            if isinstance(encoded, np.ndarray):
                tensor = torch.from_numpy(encoded.copy()).view(getattr(torch, entry.dtype)).view(entry.shape)
                self.tensors[entry.name] = tensor
            else:
                tensor = self.tensors[entry.name]
                if encoded.count:
                    positions = torch.from_numpy(_decode_positions(encoded))
                    tensor.view(-1)[positions] = torch.from_numpy(encoded.values.copy()).view(tensor.dtype)
            arrays.append(_as_bytes(tensor))
        return WeightBucket(bucket.entries, arrays, bucket.checksum)

    def finish(self, sync_id: str) -> None:
        self.base_id = sync_id
