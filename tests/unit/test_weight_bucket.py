import pickle

import pytest
import torch

from rlsearch.weights.bucket import iter_buckets, pack_bucket, unpack_bucket


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=generator)),
        ("b.bias", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("c.index", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("d.empty", torch.empty(0, 4)),
    ]


def test_bucket_round_trip_is_bit_exact_for_every_dtype():
    tensors = _tensors()
    bucket = pickle.loads(pickle.dumps(pack_bucket(tensors)))  # as it crosses a process boundary
    unpacked = unpack_bucket(bucket)
    assert [name for name, _ in unpacked] == [name for name, _ in tensors]
    for (_, original), (_, received) in zip(tensors, unpacked):
        assert received.dtype == original.dtype and received.shape == original.shape
        assert torch.equal(received, original)


def test_bucket_checksum_catches_truncation_and_corruption():
    bucket = pack_bucket(_tensors())
    for index, position in ((0, 5), (1, 13), (2, 40)):  # a word, an odd tail byte of the bf16 tensor, an int
        corrupted = pickle.loads(pickle.dumps(bucket))
        corrupted.arrays[index] = corrupted.arrays[index].copy()
        corrupted.arrays[index][position] ^= 1
        with pytest.raises(RuntimeError, match="checksum mismatch"):
            unpack_bucket(corrupted)
    truncated = pickle.loads(pickle.dumps(bucket))
    truncated.arrays[0] = truncated.arrays[0][:-8]
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        unpack_bucket(truncated)
    dropped = pickle.loads(pickle.dumps(bucket))
    dropped.arrays.pop()
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        unpack_bucket(dropped)


def test_iter_buckets_respects_the_size_and_keeps_order():
    tensors = [(f"t{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=3 * 1024))
    assert [len(b) for b in buckets] == [3, 3, 3, 1]
    names = [name for b in buckets for name, _ in b]
    assert names == [name for name, _ in tensors]
    # a tensor larger than the bucket size travels alone
    assert [len(b) for b in iter_buckets(iter(tensors), bucket_bytes=100)] == [1] * 10


def test_flat_form_round_trips_bit_exact_with_the_same_checksum_as_the_object_store_form():
    import io

    from rlsearch.weights.bucket import ALIGNMENT, FlatLayout, flatten_tensors, unflatten_tensors, write_flat

    tensors = _tensors()
    layout, flat = flatten_tensors(tensors, torch.device("cpu"))
    assert all(offset % ALIGNMENT == 0 for offset in layout.offsets)
    assert layout.checksum == pack_bucket(tensors).checksum  # the broadcast and shm forms verify alike
    staged = io.BytesIO()
    staged_layout = write_flat(pack_bucket(tensors), staged)
    assert staged_layout.to_wire() == layout.to_wire() and staged.getvalue() == bytes(flat.numpy())
    received = unflatten_tensors(FlatLayout.from_wire(layout.to_wire()), flat.clone())
    for (name, original), (received_name, tensor) in zip(tensors, received):
        assert received_name == name and tensor.dtype == original.dtype and torch.equal(tensor, original)
    for position in (3, layout.offsets[1] + 1, layout.total_bytes - 1):  # a word, the bf16 tail, the last byte
        corrupted = flat.clone()
        corrupted[position] ^= 1
        with pytest.raises(RuntimeError, match="checksum mismatch"):
            unflatten_tensors(layout, corrupted)
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        unflatten_tensors(layout, flat[:-8].clone())
