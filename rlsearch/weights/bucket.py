"""The weight-bucket wire format: HF-named tensors as raw bytes, a small index and a checksum.

A bucket has two forms with one checksum:
- `WeightBucket`, one numpy uint8 view per tensor, for Ray's object store (the shm transport): it copies each
  tensor once, straight from the sender's memory into shared memory (pickle protocol 5 out-of-band buffers).
- a flat uint8 buffer with every tensor at an 8-byte aligned offset (zero padding), described by a msgpack-able
  `FlatLayout`: what the broadcast transport sends and what the shm transport stages for the engine workers.
The checksum is a CRC32 of the index plus a 64-bit sum of the bytes as little-endian words, each tensor's bytes
zero-padded to whole words; so the two forms agree, and a receiving worker verifies the bytes it loads at memory
speed (on the GPU too, where the sum runs on the device).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
ALIGNMENT = 8


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


@dataclass
class FlatLayout:
    """Where each tensor of a bucket sits in its flat buffer; travels as `to_wire()` (plain lists)."""

    entries: list[TensorEntry]
    offsets: list[int]
    sizes: list[int]
    checksum: tuple[int, int]

    @property
    def total_bytes(self) -> int:
        return _aligned(self.offsets[-1] + self.sizes[-1]) if self.entries else 0

    @property
    def payload_bytes(self) -> int:
        return sum(self.sizes)

    def to_wire(self) -> dict:
        return {
            "entries": [[e.name, e.dtype, list(e.shape)] for e in self.entries], "offsets": list(self.offsets),
            "sizes": list(self.sizes), "checksum": list(self.checksum),
        }

    @classmethod
    def from_wire(cls, wire: dict) -> FlatLayout:
        entries = [TensorEntry(name, dtype, tuple(shape)) for name, dtype, shape in wire["entries"]]
        return cls(entries, list(wire["offsets"]), list(wire["sizes"]), tuple(wire["checksum"]))


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _word_sum(data: torch.Tensor) -> int:
    """Sum of the bytes read as little-endian 64-bit words (the last one zero-padded), modulo 2**64; on the tensor's
    device (int64 sums wrap around, which is the same sum modulo 2**64)."""
    whole = data.numel() // 8 * 8
    if whole and data.data_ptr() % 8:  # int64 views need 8-byte aligned storage
        data = data.clone()
    total = int(data[:whole].view(torch.int64).sum()) if whole else 0
    tail = bytes(data[whole:].cpu().numpy().tobytes())
    return (total + int.from_bytes(tail, "little")) & _MASK64


def _index_crc(entries: list[TensorEntry], sizes: list[int]) -> int:
    index = "|".join(f"{e.name}:{e.dtype}:{e.shape}:{size}" for e, size in zip(entries, sizes, strict=True))
    return zlib.crc32(index.encode())


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's memory (a copy only for GPU or non-contiguous tensors)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)


def _entry(name: str, tensor: torch.Tensor) -> TensorEntry:
    return TensorEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def _array_checksum(entries: list[TensorEntry], arrays: list[np.ndarray]) -> tuple[int, int]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        words = sum(_word_sum(torch.from_numpy(array)) for array in arrays)
    return _index_crc(entries, [int(a.nbytes) for a in arrays]), words & _MASK64


def pack_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> WeightBucket:
    entries = [_entry(name, tensor) for name, tensor in named_tensors]
    arrays = [_as_bytes(tensor) for _, tensor in named_tensors]
    return WeightBucket(entries, arrays, _array_checksum(entries, arrays))


def unpack_bucket(bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
    """Verify the checksum and return (name, tensor) views of the received bytes."""
    if len(bucket.arrays) != len(bucket.entries) or _array_checksum(bucket.entries, bucket.arrays) != bucket.checksum:
        raise RuntimeError("weight bucket checksum mismatch: the transfer was truncated or corrupted")
    with warnings.catch_warnings():
        # the object store hands out read-only memory; these views are only read (copied into the engine)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [
            (entry.name, torch.from_numpy(array).view(getattr(torch, entry.dtype)).view(entry.shape))
            for entry, array in zip(bucket.entries, bucket.arrays)
        ]


def flat_layout(entries: list[TensorEntry], sizes: list[int], checksum: tuple[int, int]) -> FlatLayout:
    offsets, position = [], 0
    for size in sizes:
        offsets.append(position)
        position = _aligned(position + size)
    return FlatLayout(list(entries), offsets, list(sizes), checksum)


def flatten_tensors(named_tensors: list[tuple[str, torch.Tensor]], device: torch.device,
                    allocate=None) -> tuple[FlatLayout, torch.Tensor]:
    """The tensors copied into one flat uint8 buffer and its layout (checksum of the buffer). The buffer is a new
    tensor on `device`, or ``allocate(total_bytes)``: a uint8 tensor of that size (e.g. a mapped file, which may
    hold an earlier bucket's bytes: the padding is zeroed here). Tensors copied to another device are summed where
    they are (the padding is zeros, so that is the buffer's checksum): on a GPU, not over the host copy."""
    entries = [_entry(name, tensor) for name, tensor in named_tensors]
    sizes = [tensor.numel() * tensor.element_size() for _, tensor in named_tensors]
    layout = flat_layout(entries, sizes, (0, 0))
    if allocate is None:
        flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    else:
        flat = allocate(layout.total_bytes)
    # copied off a GPU, the tensors are summed where they are; else the buffer once
    sum_sources = any(tensor.device != flat.device for _, tensor in named_tensors)
    words = 0
    for (_, tensor), offset, size in zip(named_tensors, layout.offsets, sizes):
        if size:
            source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[offset:offset + size].copy_(source)
            if sum_sources:
                words += _word_sum(source)
        flat[offset + size:_aligned(offset + size)].zero_()
    layout.checksum = (_index_crc(entries, sizes), (words if sum_sources else _word_sum(flat)) & _MASK64)
    return layout, flat


def write_flat(bucket: WeightBucket, sink) -> FlatLayout:
    """Write `bucket` in the flat form to the binary file `sink`; returns its layout (the bucket's checksum)."""
    layout = flat_layout(bucket.entries, [int(a.nbytes) for a in bucket.arrays], bucket.checksum)
    for array, offset in zip(bucket.arrays, layout.offsets):
        sink.seek(offset)
        sink.write(array.data)
    sink.truncate(layout.total_bytes)
    return layout


def unflatten_tensors(layout: FlatLayout, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Verify `flat` against the layout's checksum; (name, tensor) views of it."""
    received = (_index_crc(layout.entries, layout.sizes), _word_sum(flat)) if flat.numel() == layout.total_bytes \
        else None
    if received != tuple(layout.checksum):
        raise RuntimeError(
            f"weight bucket checksum mismatch ({flat.numel()} bytes received, {layout.total_bytes} expected): the "
            "transfer was truncated or corrupted"
        )
    return [
        (entry.name, flat[offset:offset + size].view(getattr(torch, entry.dtype)).view(entry.shape))
        for entry, offset, size in zip(layout.entries, layout.offsets, layout.sizes)
    ]


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[
        list[tuple[str, torch.Tensor]]]:
    """Group a stream of tensors into lists of about `bucket_bytes` (a larger tensor gets its own list)."""
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield pending
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pending
