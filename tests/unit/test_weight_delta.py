"""Delta encoding of weight buckets (rlsearch/weights/delta.py): bit-exact round trips and the bytes they save."""

from __future__ import annotations

import pytest
import torch

from rlsearch.weights.bucket import unpack_bucket
from rlsearch.weights.delta import DeltaBase, DeltaEncoder, SparseTensor


def _sync(encoder: DeltaEncoder, base: DeltaBase, tensors: dict[str, torch.Tensor], sync_id: str, delta_of=None):
    """One sync of `tensors` from `encoder` into `base`; returns (the bucket sent, the tensors the engine loads)."""
    encoder.start(delta_of)
    base.start()
    bucket = encoder.encode([(name, tensor.clone()) for name, tensor in tensors.items()])
    encoder.finish(sync_id)
    loaded = dict(unpack_bucket(base.apply(bucket)))  # unpack_bucket verifies the sender's checksum
    base.finish(sync_id)
    return bucket, loaded


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_small_bf16_steps_travel_as_sparse_changes_and_arrive_bit_exact():
    generator = torch.Generator().manual_seed(0)
    weights = {
        "w": (0.02 * torch.randn(512, 256, generator=generator)).to(torch.bfloat16),
        "norm": torch.ones(256, dtype=torch.bfloat16),
    }
    encoder, base = DeltaEncoder(), DeltaBase()
    first, loaded = _sync(encoder, base, weights, "s0")
    assert first.base_id is None and first.wire_bytes == first.payload_bytes  # the first sync is whole
    assert all(_bits_equal(loaded[name], weights[name]) for name in weights)
    total_wire, total_payload = 0, 0
    master = {name: tensor.float() for name, tensor in weights.items()}
    for step in range(1, 4):  # Adam-sized steps of lr 1e-6 on fp32 master weights, exported in bf16
        for name in master:
            master[name] += 1e-6 * torch.sign(torch.randn(master[name].shape, generator=generator))
        weights = {name: tensor.to(torch.bfloat16) for name, tensor in master.items()}
        bucket, loaded = _sync(encoder, base, weights, f"s{step}", delta_of=f"s{step - 1}")
        assert bucket.base_id == f"s{step - 1}"
        assert isinstance(bucket.tensors[0], SparseTensor)
        assert all(_bits_equal(loaded[name], weights[name]) for name in weights)
        total_wire += bucket.wire_bytes
        total_payload += bucket.payload_bytes
    assert total_payload / total_wire >= 20, (total_payload, total_wire)


def test_every_bit_pattern_survives_and_dense_changes_travel_whole():
    weights = {"x": torch.tensor([0.0, 1.0, 2.0, float("nan"), 4.0] * 20), "y": torch.arange(6.0)}
    encoder, base = DeltaEncoder(), DeltaBase()
    _sync(encoder, base, weights, "a")
    changed = {"x": weights["x"].clone(), "y": weights["y"] + 1}  # y: every element changes
    changed["x"][0] = -0.0  # 0.0 -> -0.0 is a change of one bit
    changed["x"][3] = float("-nan")
    bucket, loaded = _sync(encoder, base, changed, "b", delta_of="a")
    sparse, dense = bucket.tensors
    assert isinstance(sparse, SparseTensor) and sparse.count == 2
    assert not isinstance(dense, SparseTensor)  # its changes would take more than the tensor
    assert all(_bits_equal(loaded[name], changed[name]) for name in changed)


def test_a_delta_against_other_weights_is_refused_and_a_changed_shape_travels_whole():
    encoder, base = DeltaEncoder(), DeltaBase()
    _sync(encoder, base, {"w": torch.zeros(8)}, "a")
    base.start()
    base.finish("other")  # the engine took another sync meanwhile (e.g. a plain one)
    encoder.start("a")
    bucket = encoder.encode([("w", torch.ones(8))])
    base.start()
    with pytest.raises(RuntimeError, match="a delta against weights a reached an engine holding other"):
        base.apply(bucket)
    # an encoder asked for a delta against weights it does not hold sends everything whole
    assert encoder.start("unknown") is None
    assert encoder.encode([("w", torch.ones(8))]).base_id is None
    encoder.finish("c")
    _, loaded = _sync(DeltaEncoder(), DeltaBase(), {"w": torch.ones(3, 2)}, "d")
    assert loaded["w"].shape == (3, 2)
