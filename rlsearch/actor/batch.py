"""What the actor trains on (plain data) and how it becomes packed micro-batch tensors.

A micro-batch is one row of sequences concatenated back to back (Megatron's `thd` packed format) up to
`max_tokens` tokens, with no padding. Only response positions need logits: a micro-batch carries the flat
index of the positions whose next token is a response token, and every per-token tensor is 1-D over them.
A training step needs even fewer: with `trained_only` only the positions predicting a loss-masked token are
selected (not the tool observations, which carry zero weight), since the vocabulary projection dominates the
cost of a small model and observations are most of a search trajectory's response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from ..devices import local_device
from ..megatron.layout import AttentionBlock, PrefixTree, RowLayout, cp_shard, padded_length


@dataclass
class TrainSample:
    """One trajectory as the actor sees it. Per-token lists cover the response (token_ids[response_start:])."""

    token_ids: list[int]
    response_start: int
    loss_mask: list[int]
    advantage: float = 0.0
    token_weights: list[float] | None = None  # loss aggregation weights (algo.loss_token_weights)
    old_logprobs: list[float] | None = None  # None: on-policy, the current logprobs (ratio 1)
    ref_logprobs: list[float] | None = None
    rollout_logprobs: list[float] | None = None  # the engine's: rollout corrections, the ratio, the drift metric
    # segments of one trajectory share a group: with actor.merge_prefixes they train as one prefix tree
    prefix_group: int | None = None
    # MoE routing to replay (algo.routing_replay): [len(token_ids), layers, top-k] expert ids per token and layer
    # (-1 for dense layers), recorded when the old logprobs were computed
    routed_experts: torch.Tensor | None = None
    # per response token, where they differ (turn-level credit, algo.advantage); None: `advantage` for every token.
    # Last, so that the fields before it keep their positions
    advantages: list[float] | None = None
    # the samples of one GRPO group (one prompt): with actor.merge_prefixes their tree trains the shared prompt once
    # where the whole group fits a micro-batch, else each trajectory's tree (prefix_group) goes on its own
    prompt_group: int | None = None
    # the critic's (algo.advantage=gae), per response token: the value targets it trains towards, and its values when
    # the advantages were computed (the clipped value loss stays near them)
    returns: list[float] | None = None
    old_values: list[float] | None = None

    def __post_init__(self) -> None:
        if self.response_start < 1 or self.response_start > len(self.token_ids):
            raise ValueError(f"response_start={self.response_start} outside a sequence of {len(self.token_ids)}")
        if self.routed_experts is not None and self.routed_experts.shape[0] != len(self.token_ids):
            raise ValueError(f"routed_experts covers {self.routed_experts.shape[0]} tokens of {len(self.token_ids)}")
        for name in ("loss_mask", "advantages", "token_weights", "old_logprobs", "ref_logprobs", "rollout_logprobs",
                     "returns", "old_values"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_len:
                raise ValueError(f"{name} has {len(values)} entries for {self.response_len} response tokens")

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.response_start


@dataclass
class MicroBatch:
    sample_indices: list[int]  # positions of the packed samples in the caller's list, in packing order
    tokens: torch.Tensor  # [1, rows]: this rank's rows of the packed samples (all of them without CP)
    position_ids: torch.Tensor  # [1, rows]: each token's position in its sample (depth in a prefix tree)
    cu_seqlens: torch.Tensor  # [units + 1] int32 boundaries of the packed units in the whole row (real tokens)
    cu_seqlens_padded: torch.Tensor | None  # the same, each unit padded to a multiple of 2 x cp (with CP only)
    max_seqlen: int
    layout: RowLayout  # what each row attends to (rlsearch.megatron.layout)
    logit_index: torch.Tensor  # [n] rows whose next token is a selected (with trained_only: trained) response token
    labels: torch.Tensor  # [n] the response token predicted at each selected position
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    token_weights: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    response_lens: list[int]  # selected positions per sample, over all CP ranks
    sample_rows: list[torch.Tensor]  # each packed sample's row per token (before a CP split)
    selection: torch.Tensor | None = None  # with CP: each of this rank's selected positions' index among all of them
    routed_experts: torch.Tensor | None = None  # [rows, layers, top-k]: the samples' routing to replay, per row
    returns: torch.Tensor | None = None  # the critic's value targets
    old_values: torch.Tensor | None = None  # the critic's values the advantages came from
    # where selected positions repeat a (row, label) pair (samples of a merged group sharing a response prefix): the
    # first position of each distinct pair, the only ones the output layer projects, and each position's pair among
    # them; None when every pair is distinct. So a micro-batch never projects more positions than it has rows
    distinct_positions: torch.Tensor | None = None  # [u]
    pair_of_position: torch.Tensor | None = None  # [n]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def projected_rows(self) -> torch.Tensor:
        """The rows the output layer projects: one per distinct (row, label) pair of the selected positions."""
        return self.logit_index if self.distinct_positions is None else self.logit_index[self.distinct_positions]

    @property
    def projected_labels(self) -> torch.Tensor:
        """The label of each projected row's pair."""
        return self.labels if self.distinct_positions is None else self.labels[self.distinct_positions]

    def per_position(self, figures: torch.Tensor) -> torch.Tensor:
        """Figures of the projected pairs (logprobs, entropies, values) laid out per selected position."""
        return figures if self.pair_of_position is None else figures[self.pair_of_position]

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: v.to(device) for k, v in moved.items() if isinstance(v, (torch.Tensor, RowLayout))}
        return replace(self, **moved)

    def packed_seq_params(self):
        """Megatron's packed-sequence parameters, carrying the layout for the local spec's attention."""
        from megatron.core.packed_seq_params import PackedSeqParams

        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen,
        )
        params.layout = self.layout
        return params


def _flat(samples: Sequence[TrainSample], name: str, kept: Sequence[Sequence[int]]) -> torch.Tensor | None:
    values = [getattr(s, name) for s in samples]
    if any(v is None for v in values):
        return None
    return torch.tensor([v[r] for v, rows in zip(values, kept) for r in rows], dtype=torch.float)


def _flat_or_zeros(samples: Sequence[TrainSample], name: str, kept: Sequence[Sequence[int]]) -> torch.Tensor:
    values = _flat(samples, name, kept)
    return values if values is not None else torch.zeros(sum(len(rows) for rows in kept))


def _kept_positions(samples: Sequence[TrainSample], trained_only: bool) -> list[list[int]]:
    """Per sample the response offsets that get logits: all of them, or with `trained_only` those whose loss mask is
    set. A micro-batch without a trained token (an empty data-parallel shard's zero-weight stand-in) keeps all, so
    the output layer still sees its input and takes part in the backward pass."""
    every = [list(range(s.response_len)) for s in samples]
    if not trained_only:
        return every
    trained = [[r for r in rows if s.loss_mask[r]] for s, rows in zip(samples, every)]
    return trained if any(trained) else every


def pack_indices(lengths: Sequence[int], max_tokens: int, min_bins: int = 1) -> list[list[int]]:
    """Group sample indices into bins of at most `max_tokens` tokens (first-fit decreasing; a longer sample gets
    a bin of its own). At least `min_bins` bins when there are that many samples, so every pipeline stage has
    work. Each bin lists its indices in ascending order; bins are ordered by their first index."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    capacity = min(max_tokens, max(-(-sum(lengths) // max(min_bins, 1)), max(lengths, default=0)))
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in order:
        for b, load in enumerate(loads):
            if load + lengths[index] <= capacity:
                bins[b].append(index)
                loads[b] += lengths[index]
                break
        else:
            bins.append([index])
            loads.append(lengths[index])
    while len(bins) < min(min_bins, len(lengths)):
        largest = max(range(len(bins)), key=lambda b: (len(bins[b]), loads[b]))
        moved = sorted(bins[largest])[-1]
        bins[largest].remove(moved)
        loads[largest] -= lengths[moved]
        bins.append([moved])
        loads.append(lengths[moved])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


@dataclass(frozen=True)
class Packing:
    """How a rank packs its samples: `merge_prefixes` trains the samples of one GRPO group (the same `prompt_group`),
    or the segments of one trajectory (the same `prefix_group`), as one prefix tree; with context parallelism `cp` > 1
    the rank keeps its `cp_rank`'s rows."""

    merge_prefixes: bool = False
    cp: int = 1
    cp_rank: int = 0


def _units(samples: Sequence[TrainSample], merge_prefixes: bool) -> list[list[int]]:
    """Sample indices per packed unit: a sample alone, or with `merge_prefixes` every sample of a prompt group (of
    a prefix group where it has none)."""
    if not merge_prefixes:
        return [[i] for i in range(len(samples))]
    return _grouped(samples, range(len(samples)), by_prompt=True)


def _grouped(samples: Sequence[TrainSample], indices, by_prompt: bool) -> list[list[int]]:
    """`indices` by prompt group (`by_prompt`), else by prefix group; a sample in neither alone."""
    groups: dict[object, list[int]] = {}
    for i in indices:
        sample = samples[i]
        if by_prompt and sample.prompt_group is not None:
            key = ("prompt", sample.prompt_group)
        else:
            key = ("prefix", sample.prefix_group) if sample.prefix_group is not None else ("alone", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _fitting_units(samples: Sequence[TrainSample], unit: list[int], packing: Packing, max_tokens: int
                   ) -> list[tuple[list[int], int]]:
    """(unit, its rows): `unit` where its tree fits `max_tokens`; else sub-trees that fit: a prompt group's
    trajectories' trees (prefix groups), a tree that does not fit (a folded trajectory's segments) by its samples,
    neighbours joined again while their tree fits, so a group one token over keeps most of its sharing."""
    length = unit_length([samples[i] for i in unit], packing)
    if len(unit) == 1 or length <= max_tokens:
        return [(unit, length)]
    parts = [fitted for part in _parts(samples, unit) for fitted in _fitting_units(samples, part, packing, max_tokens)]
    joined: list[tuple[list[int], int]] = []
    for part, part_length in parts:
        if joined:
            together = joined[-1][0] + part
            together_length = unit_length([samples[i] for i in together], packing)
            if together_length <= max_tokens:
                joined[-1] = (together, together_length)
                continue
        joined.append((part, part_length))
    return joined


def _parts(samples: Sequence[TrainSample], unit: list[int]) -> list[list[int]]:
    """What a unit splits into first: a prompt group into its trajectories' trees, a tree into its samples."""
    if samples[unit[0]].prompt_group is not None:
        trees = _grouped(samples, unit, by_prompt=False)
        if len(trees) > 1:
            return trees
    return [[i] for i in unit]


def _at_least(samples: Sequence[TrainSample], fitted: list[tuple[list[int], int]], count: int, packing: Packing
              ) -> list[tuple[list[int], int]]:
    """`fitted` with its largest merged units split in halves (of their `_parts`) until there are `count` units or
    none is left to split: every pipeline stage gets a micro-batch."""
    fitted = list(fitted)
    while len(fitted) < count and any(len(unit) > 1 for unit, _ in fitted):
        largest = max((i for i, (unit, _) in enumerate(fitted) if len(unit) > 1), key=lambda i: fitted[i][1])
        parts = _parts(samples, fitted.pop(largest)[0])
        halves = ([i for part in parts[:len(parts) // 2] for i in part],
                  [i for part in parts[len(parts) // 2:] for i in part])
        fitted[largest:largest] = [(half, unit_length([samples[i] for i in half], packing)) for half in halves]
    return fitted


def _unit_rows(samples: Sequence[TrainSample]) -> tuple[list[int], list[int], list[AttentionBlock], list[list[int]]]:
    """A unit's tokens, positions and attention blocks (from row 0), and each sample's row per token."""
    if len(samples) == 1:
        length = len(samples[0].token_ids)
        return list(samples[0].token_ids), list(range(length)), [AttentionBlock(0, length, 0)], [list(range(length))]
    tree = PrefixTree([sample.token_ids for sample in samples])
    return tree.row(), tree.positions(), tree.blocks(0), [tree.row_positions(i) for i in range(len(samples))]


def _shift(blocks: list[AttentionBlock], offset: int) -> list[AttentionBlock]:
    return [AttentionBlock(b.query_start + offset, b.query_end + offset, b.own_start + offset,
                           tuple((start + offset, end + offset) for start, end in b.prefix)) for b in blocks]


def unit_length(samples: Sequence[TrainSample], packing: Packing) -> int:
    """Rows a unit takes in a micro-batch (its tree's size when merged; padded for CP)."""
    length = len(samples[0].token_ids) if len(samples) == 1 else PrefixTree([s.token_ids for s in samples]).size
    return padded_length(length, packing.cp) if packing.cp > 1 else length


def collate(
    samples: Sequence[TrainSample], sample_indices: Sequence[int], trained_only: bool = False,
    units: Sequence[Sequence[int]] | None = None, packing: Packing = Packing(),
) -> MicroBatch:
    """Pack `samples` into one row (thd): every unit (`units`: positions in `samples`, default one per sample) back
    to back; logits at every response position, or only at trained ones. With CP the micro-batch holds this rank's
    rows and the selected positions among them."""
    kept = _kept_positions(samples, trained_only)
    units = units if units is not None else [[i] for i in range(len(samples))]
    tokens: list[int] = []
    positions: list[int] = []
    blocks: list[AttentionBlock] = []
    boundaries, padded_boundaries = [0], [0]
    rows_of: dict[int, list[int]] = {}
    for unit in units:
        offset = len(tokens)
        unit_tokens, unit_positions, unit_blocks, unit_rows = _unit_rows([samples[i] for i in unit])
        boundaries.append(boundaries[-1] + len(unit_tokens))
        if packing.cp > 1:
            # pad tokens at the end of the unit's last block: no real token attends to them
            pad = padded_length(len(unit_tokens), packing.cp) - len(unit_tokens)
            last = unit_blocks[-1]
            unit_blocks[-1] = AttentionBlock(last.query_start, last.query_end + pad, last.own_start, last.prefix)
            unit_positions += range(unit_positions[-1] + 1, unit_positions[-1] + 1 + pad)
            unit_tokens += [0] * pad
        tokens += unit_tokens
        positions += unit_positions
        blocks += _shift(unit_blocks, offset)
        rows_of.update({i: [offset + row for row in rows] for i, rows in zip(unit, unit_rows)})
        padded_boundaries.append(len(tokens))
    # position t predicts token t + 1 of the same sample
    index = torch.tensor([rows_of[i][s.response_start - 1 + r] for i, (s, rows) in enumerate(zip(samples, kept))
                          for r in rows], dtype=torch.long)
    per_token = dict(
        labels=torch.tensor([s.token_ids[s.response_start + r] for s, rows in zip(samples, kept) for r in rows],
                            dtype=torch.long),
        loss_mask=_flat(samples, "loss_mask", kept),
        advantages=torch.tensor([s.advantage if s.advantages is None else s.advantages[r]
                                 for s, rows in zip(samples, kept) for r in rows], dtype=torch.float),
        token_weights=_flat_or_zeros(samples, "token_weights", kept),
        old_logprobs=_flat(samples, "old_logprobs", kept),
        ref_logprobs=_flat(samples, "ref_logprobs", kept),
        rollout_logprobs=_flat(samples, "rollout_logprobs", kept),
        returns=_flat(samples, "returns", kept),
        old_values=_flat(samples, "old_values", kept),
    )
    row_tokens, row_positions = torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
    layout = RowLayout(row_positions, blocks)
    sample_rows = [torch.tensor(rows_of[i], dtype=torch.long) for i in range(len(samples))]
    routed_experts = _routed_rows(samples, sample_rows, len(tokens))
    selection = None
    if packing.cp > 1:
        if routed_experts is not None:
            raise ValueError("routing replay with context parallelism is not supported (MoE runs with cp=1)")
        shards = [cp_shard(blocks, padded_boundaries, packing.cp, rank) for rank in range(packing.cp)]
        rows, cp_blocks = shards[packing.cp_rank]
        local_row = torch.full((len(tokens),), -1, dtype=torch.long)
        local_row[rows] = torch.arange(len(rows))
        selection = torch.nonzero(local_row[index] >= 0).flatten()
        index = local_row[index[selection]]
        per_token = {k: v[selection] if v is not None else None for k, v in per_token.items()}
        row_tokens, row_positions = row_tokens[rows], row_positions[rows]
        layout = RowLayout(row_positions, cp_blocks, torch.argsort(torch.cat([shard[0] for shard in shards])))
    distinct_positions, pair_of_position = _distinct_pairs(index, per_token["labels"])
    int32 = dict(dtype=torch.int32)
    return MicroBatch(
        sample_indices=list(sample_indices),
        tokens=row_tokens.unsqueeze(0),
        position_ids=row_positions.unsqueeze(0),
        cu_seqlens=torch.tensor(boundaries, **int32),
        cu_seqlens_padded=torch.tensor(padded_boundaries, **int32) if packing.cp > 1 else None,
        max_seqlen=max(b - a for a, b in zip(padded_boundaries[:-1], padded_boundaries[1:])),
        layout=layout,
        logit_index=index,
        response_lens=[len(rows) for rows in kept],
        sample_rows=sample_rows,
        selection=selection,
        routed_experts=routed_experts,
        distinct_positions=distinct_positions,
        pair_of_position=pair_of_position,
        **per_token,
    )


def _distinct_pairs(rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the first position of each distinct (row, label) pair, each position's pair), or (None, None) when no pair
    repeats. A prefix tree has one pair per edge, so the distinct pairs never outnumber its rows."""
    pairs, pair_of_position = torch.unique(torch.stack([rows, labels], dim=1), dim=0, return_inverse=True)
    if pairs.shape[0] == rows.shape[0]:
        return None, None
    first = torch.full((pairs.shape[0],), rows.shape[0], dtype=torch.long)
    first.scatter_reduce_(0, pair_of_position, torch.arange(rows.shape[0]), reduce="amin")
    return first, pair_of_position


def _routed_rows(samples: Sequence[TrainSample], sample_rows: Sequence[torch.Tensor], rows: int) -> torch.Tensor | None:
    """The samples' recorded routing laid out per row (rows a prefix tree shares hold the same routing)."""
    if all(sample.routed_experts is None for sample in samples):
        return None
    if any(sample.routed_experts is None for sample in samples):
        raise ValueError("routing replay needs every sample's routing; some samples have none")
    first = samples[0].routed_experts
    routed = torch.full((rows, *first.shape[1:]), -1, dtype=first.dtype)
    for sample, sample_row in zip(samples, sample_rows):
        routed[sample_row] = sample.routed_experts
    return routed


def pack_micro_batches(
    samples: Sequence[TrainSample], max_tokens: int, min_micro_batches: int = 1, trained_only: bool = False,
    packing: Packing = Packing(),
) -> list[MicroBatch]:
    """Packed micro-batches on the rank's device (where its model is): its GPU when it has one, else CPU.
    `trained_only`: logits only where the loss mask is set (a training step). A prefix tree larger than
    `max_tokens` goes apart into sub-trees that fit (`_fitting_units`); merged units split further where there would
    be fewer than `min_micro_batches` (`_at_least`)."""
    device = local_device()
    fitted = [part for unit in _units(samples, packing.merge_prefixes)
              for part in _fitting_units(samples, unit, packing, max_tokens)]
    fitted = _at_least(samples, fitted, min_micro_batches, packing)
    units, lengths = [unit for unit, _ in fitted], [length for _, length in fitted]
    batches = []
    for unit_bin in pack_indices(lengths, max_tokens, min_micro_batches):
        indices = sorted(i for u in unit_bin for i in units[u])
        local = {index: position for position, index in enumerate(indices)}
        bin_units = [[local[i] for i in units[u]] for u in unit_bin]
        batches.append(collate([samples[i] for i in indices], indices, trained_only, bin_units, packing).to(device))
    return batches
