"""Attention blocks (rlsearch.megatron.layout, .attention): a prefix tree and context-parallel shards attend exactly as
each sequence on its own does, in plain torch (no ranks)."""

from __future__ import annotations

import pytest
import torch

from rlsearch.actor.batch import Packing, TrainSample, collate
from rlsearch.megatron.attention import blocked_attention
from rlsearch.megatron.layout import PrefixTree

HEADS, GROUPS, DIM = 4, 2, 8
torch.manual_seed(0)
TABLES = {name: torch.randn(64, 160, heads, DIM, dtype=torch.float64) for name, heads in
          (("q", HEADS), ("k", GROUPS), ("v", GROUPS))}


def _project(tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Query, key and value rows that depend on each row's token and position (as rotated projections do)."""
    return tuple(TABLES[name][tokens % 64, positions] for name in ("q", "k", "v"))


def _alone(sequence: list[int]) -> torch.Tensor:
    """Causal attention over one sequence by itself."""
    tokens = torch.tensor(sequence)
    q, k, v = _project(tokens, torch.arange(len(sequence)))
    return blocked_attention(q, k, v, collate([TrainSample(sequence, 1, [0] * (len(sequence) - 1))], [0])
                             .layout.blocks, scale=0.3)


def _segments(shared: int, seed: int) -> list[list[int]]:
    """Four re-rendered segments of one trajectory: each repeats `shared` tokens of the one before and continues
    differently (shared = 0: nothing in common)."""
    generator = torch.Generator().manual_seed(seed)
    segments, history = [], []
    for turn in range(4):
        tail = torch.randint(0, 10_000, (9 + 5 * turn,), generator=generator).tolist()
        segments.append(history[:shared] + tail)
        history = segments[-1]
    return segments


def _use_masked_kernel(monkeypatch, masked_rows: int) -> None:
    """Blocks with a prefix through the boolean-mask kernel (GPU, dropout) in blocks of `masked_rows` query rows,
    instead of the CPU's mask-free flash kernel."""
    from rlsearch.megatron import attention

    monkeypatch.setattr(attention, "MASKED_QUERY_ROWS", masked_rows)
    monkeypatch.setattr(attention, "_prefix_then_causal", lambda q, pk, pv, ok, ov, scale:
                        attention._masked_prefix_then_causal(q, pk, pv, ok, ov, scale, 0.0))


@pytest.mark.parametrize("shared", [0, 3, 9])
@pytest.mark.parametrize("kernel", ["flash", "masked", "masked-4-rows"])
def test_prefix_tree_attends_as_each_segment_alone(shared, kernel, monkeypatch):
    if kernel != "flash":
        _use_masked_kernel(monkeypatch, 4 if kernel == "masked-4-rows" else 2048)
    segments = _segments(shared, seed=shared) + [[7, 7, 7]]
    samples = [TrainSample(s, 1, [1] * (len(s) - 1), prefix_group=0 if i < 4 else None)
               for i, s in enumerate(segments)]
    batch = collate(samples, list(range(len(samples))), units=[[0, 1, 2, 3], [4]])
    assert batch.num_tokens == PrefixTree(segments[:4]).size + 3
    assert batch.num_tokens == sum(map(len, segments)) - 3 * shared
    q, k, v = _project(batch.tokens[0], batch.position_ids[0])
    merged = blocked_attention(q, k, v, batch.layout.blocks, scale=0.3)
    rows = batch.logit_index.split(batch.response_lens)
    for segment, segment_rows in zip(segments, rows):
        # a segment's selected rows are its tokens 0 .. n-2 (each predicts the next)
        expected = _alone(segment)[:-1]
        assert (merged[segment_rows] - expected).abs().max().item() < 1e-12
        assert torch.equal(batch.tokens[0][segment_rows], torch.tensor(segment[:-1]))


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("merge", [False, True])
def test_context_parallel_shards_attend_as_the_whole_row(cp, merge):
    segments = _segments(6, seed=1) + [[5] * 11, [9] * 2]
    samples = [TrainSample(s, 1, [1] * (len(s) - 1), prefix_group=0 if i < 4 else None)
               for i, s in enumerate(segments)]
    units = [[0, 1, 2, 3], [4], [5]] if merge else [[i] for i in range(len(samples))]
    whole = collate(samples, list(range(len(samples))), units=units)
    q, k, v = _project(whole.tokens[0], whole.position_ids[0])
    reference = blocked_attention(q, k, v, whole.layout.blocks, scale=0.3)
    selected = torch.zeros(sum(whole.response_lens), dtype=torch.long)
    shards = [collate(samples, list(range(len(samples))), units=units, packing=Packing(cp=cp, cp_rank=rank))
              for rank in range(cp)]
    projected = [_project(shard.tokens[0], shard.position_ids[0]) for shard in shards]
    for shard, (q_local, _, _) in zip(shards, projected):
        assert shard.num_tokens * cp == int(shard.cu_seqlens_padded[-1])
        keys, values = (torch.cat([p[i] for p in projected])[shard.layout.gather_order] for i in (1, 2))
        out = blocked_attention(q_local, keys, values, shard.layout.blocks, scale=0.3)
        # this rank's selected positions hold the whole row's attention at the same tokens
        local_rows = shard.logit_index
        whole_rows = whole.logit_index[shard.selection]
        assert torch.equal(shard.tokens[0][local_rows], whole.tokens[0][whole_rows])
        assert (out[local_rows] - reference[whole_rows]).abs().max().item() < 1e-12
        assert torch.equal(shard.labels, whole.labels[shard.selection])
        selected[shard.selection] += 1
    assert torch.equal(selected, torch.ones_like(selected))  # every selected position on exactly one rank


def test_flash_and_masked_kernels_agree_in_value_and_gradient(monkeypatch):
    """The CPU kernel's own backward (two flash backward calls over the merged log-sum-exp) against autograd through
    the masked kernel, for a CP-like block: 40 queries over a 70-key prefix and their own keys."""
    from rlsearch.megatron.attention import _masked_prefix_then_causal, _prefix_then_causal

    generator = torch.Generator().manual_seed(5)
    shapes = {"q": (40, HEADS), "pk": (70, GROUPS), "pv": (70, GROUPS), "ok": (40, GROUPS), "ov": (40, GROUPS)}
    inputs = {name: torch.randn(*shape, DIM, generator=generator, dtype=torch.float64) for name, shape in
              shapes.items()}
    upstream = torch.randn(40, HEADS, DIM, generator=generator, dtype=torch.float64)
    results = []
    for kernel in (_prefix_then_causal, lambda *args: _masked_prefix_then_causal(*args, 0.0)):
        leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
        out = kernel(*leaves.values(), 0.35)
        (out * upstream).sum().backward()
        results.append((out.detach(), {name: x.grad for name, x in leaves.items()}))
    (flash_out, flash_grads), (masked_out, masked_grads) = results
    assert (flash_out - masked_out).abs().max().item() < 1e-12
    for name in inputs:
        assert (flash_grads[name] - masked_grads[name]).abs().max().item() < 1e-12, name
        assert flash_grads[name].abs().max().item() > 1e-3  # every input gets a gradient
