"""The weight-bucket wire format: HF-named tensors as raw byte arrays plus a small index and a checksum.

Each tensor travels as a numpy uint8 view of its own memory, so Ray's object store copies it once, straight
from the sender's tensor into shared memory (pickle protocol 5 out-of-band buffers, no staging buffer), and the
receiver maps it zero-copy; the tensors it gets back are views of that shared memory. A 64-bit word sum over
the bytes, plus a CRC32 of the index, catches truncated or corrupted transfers at memory speed.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]


@dataclass
class WeightBucket:
    entries: list[TensorEntry]
    arrays: list[np.ndarray]  # uint8, one per entry
    checksum: tuple[int, int]  # (CRC32 of the index, 64-bit word sum of the bytes)

    @property
    def nbytes(self) -> int:
        return sum(int(array.nbytes) for array in self.arrays)

    def __len__(self) -> int:
        return len(self.entries)


def _word_sum(array: np.ndarray) -> int:
    words = array.nbytes // 8
    total = int(array[: words * 8].view(np.uint64).sum(dtype=np.uint64)) if words else 0
    return (total + int(array[words * 8 :].sum(dtype=np.uint64)) * 0x9E3779B1) & _MASK64


def _checksum(entries: list[TensorEntry], arrays: list[np.ndarray]) -> tuple[int, int]:
    index = "|".join(f"{e.name}:{e.dtype}:{e.shape}:{a.nbytes}" for e, a in zip(entries, arrays, strict=True))
    return zlib.crc32(index.encode()), sum(_word_sum(a) for a in arrays) & _MASK64


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's memory (a copy only for GPU or non-contiguous tensors)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def pack_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> WeightBucket:
    entries = [TensorEntry(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in named_tensors]
    arrays = [_as_bytes(tensor) for _, tensor in named_tensors]
    return WeightBucket(entries, arrays, _checksum(entries, arrays))


def unpack_bucket(bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
    """Verify the checksum and return (name, tensor) views of the received bytes."""
    if len(bucket.arrays) != len(bucket.entries) or _checksum(bucket.entries, bucket.arrays) != bucket.checksum:
        raise RuntimeError("weight bucket checksum mismatch: the transfer was truncated or corrupted")
    with warnings.catch_warnings():
        # the object store hands out read-only memory; these views are only read (copied into the engine)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [
            (entry.name, torch.from_numpy(array).view(getattr(torch, entry.dtype)).view(entry.shape))
            for entry, array in zip(bucket.entries, bucket.arrays)
        ]


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Group a stream of tensors into buckets of about `bucket_bytes` (a larger tensor gets its own bucket)."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield pack_bucket(pending)
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pack_bucket(pending)
