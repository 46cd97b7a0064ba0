"""Where each token of a packed micro-batch sits and what it attends to: plain sequences, prefix trees and
context-parallel shards described the same way, as attention blocks over one row of tokens.

A block is a run of query rows that attends to some fully visible key ranges (its prefix) and causally to its own
keys. A packed sequence is one block without a prefix. A prefix tree (the segments of one trajectory that share
a token prefix, merged so the prefix is computed once) is one block per branch whose prefix is its ancestors. A
context-parallel rank holds two chunks of every sequence (Megatron's load-balanced layout: chunks r and 2cp-1-r of
2cp); each is a block whose prefix is the sequence before it. Positions (for rotary embeddings) are each token's
depth in its sequence or tree, so a branch continues its ancestors' positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionBlock:
    query_start: int  # rows [query_start, query_end) of this rank's part of the row
    query_end: int
    own_start: int  # the block's own keys: [own_start, own_start + length) of the whole (gathered) row
    prefix: tuple[tuple[int, int], ...] = ()  # key ranges [start, end) of the whole row, visible to every query

    @property
    def length(self) -> int:
        return self.query_end - self.query_start


@dataclass
class RowLayout:
    """What the attention module needs besides the tokens: rotary positions of this rank's rows, the blocks, and
    with context parallelism the order that turns the ranks' gathered rows back into the whole row."""

    positions: torch.Tensor  # [rows] long
    blocks: list[AttentionBlock]
    gather_order: torch.Tensor | None = None  # [whole row] index into the CP ranks' rows concatenated in rank order
    rotary: torch.Tensor | None = None  # [rows, 1, 1, dim] rotary angles of the positions (set by the actor)

    def to(self, device: torch.device) -> RowLayout:
        moved = (x.to(device) if x is not None else None for x in (self.gather_order, self.rotary))
        return RowLayout(self.positions.to(device), self.blocks, *moved)


@dataclass
class _Node:
    tokens: list[int]
    parent: int  # -1: a root
    children: dict[int, int] = field(default_factory=dict)  # first token -> node index


class PrefixTree:
    """The sequences of one unit with shared prefixes stored once (a radix tree). `row()` lays it out depth-first,
    each node right after its parent's subtree begins; `row_positions(i)` maps sequence i's tokens to that row."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        self.nodes: list[_Node] = []
        self._roots: dict[int, int] = {}
        for sequence in sequences:
            self._insert(list(sequence))
        self._order = self._depth_first()
        self._start: dict[int, int] = {}
        offset = 0
        for node in self._order:
            self._start[node] = offset
            offset += len(self.nodes[node].tokens)
        self.size = offset
        self._sequences = [list(s) for s in sequences]

    def _children(self, parent: int) -> dict[int, int]:
        return self._roots if parent < 0 else self.nodes[parent].children

    def _insert(self, sequence: list[int]) -> None:
        parent, pos = -1, 0
        while pos < len(sequence):
            child = self._children(parent).get(sequence[pos])
            if child is None:
                self.nodes.append(_Node(sequence[pos:], parent))
                self._children(parent)[sequence[pos]] = len(self.nodes) - 1
                return
            node = self.nodes[child]
            common = _common_prefix(node.tokens, sequence, pos)
            if common < len(node.tokens):  # split: the node keeps the shared head, a new child takes its tail
                tail = _Node(node.tokens[common:], child, node.children)
                self.nodes.append(tail)
                for grandchild in tail.children.values():
                    self.nodes[grandchild].parent = len(self.nodes) - 1
                node.tokens, node.children = node.tokens[:common], {tail.tokens[0]: len(self.nodes) - 1}
            parent, pos = child, pos + common

    def _depth_first(self) -> list[int]:
        order, stack = [], list(reversed(self._roots.values()))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.nodes[node].children.values()))
        return order

    def row(self) -> list[int]:
        return [token for node in self._order for token in self.nodes[node].tokens]

    def _depth(self, node: int) -> int:
        depth, parent = 0, self.nodes[node].parent
        while parent >= 0:
            depth += len(self.nodes[parent].tokens)
            parent = self.nodes[parent].parent
        return depth

    def positions(self) -> list[int]:
        return [self._depth(node) + i for node in self._order for i in range(len(self.nodes[node].tokens))]

    def row_positions(self, index: int) -> list[int]:
        """Row offset of each token of sequence `index`."""
        sequence, result = self._sequences[index], []
        parent = -1
        while len(result) < len(sequence):
            node = self._children(parent)[sequence[len(result)]]
            start = self._start[node]
            result.extend(range(start, start + len(self.nodes[node].tokens)))
            parent = node
        return result[: len(sequence)]

    def _end(self, node: int, offset: int) -> int:
        return offset + self._start[node] + len(self.nodes[node].tokens)

    def blocks(self, offset: int) -> list[AttentionBlock]:
        """Attention blocks of the tree placed at row offset `offset`: an only child continues its parent's block
        (it follows it in the row), every other node starts a block whose prefix is its ancestors."""
        blocks: list[AttentionBlock] = []
        block_of: dict[int, int] = {}
        for node in self._order:
            start = offset + self._start[node]
            end = start + len(self.nodes[node].tokens)
            parent = self.nodes[node].parent
            if parent >= 0 and len(self.nodes[parent].children) == 1:
                index = block_of[parent]
                block = blocks[index]
                blocks[index] = AttentionBlock(block.query_start, end, block.own_start, block.prefix)
            else:
                prefix = blocks[block_of[parent]] if parent >= 0 else None
                ranges = (*prefix.prefix, (prefix.own_start, self._end(parent, offset))) if prefix else ()
                blocks.append(AttentionBlock(start, end, start, _merge_ranges(ranges)))
                index = len(blocks) - 1
            block_of[node] = index
        return blocks


def _common_prefix(tokens: list[int], sequence: list[int], start: int) -> int:
    limit = min(len(tokens), len(sequence) - start)
    for i in range(limit):
        if tokens[i] != sequence[start + i]:
            return i
    return limit


def _merge_ranges(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if end <= start:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return tuple(merged)


def padded_length(length: int, cp: int) -> int:
    """A sequence's length padded to a multiple of 2 x cp (its 2cp chunks must be equal)."""
    multiple = 2 * cp
    return -(-length // multiple) * multiple


def cp_shard(
    blocks: Sequence[AttentionBlock], boundaries: Sequence[int], cp: int, rank: int
) -> tuple[torch.Tensor, list[AttentionBlock]]:
    """Context-parallel rank `rank`'s part of a packed row: chunks rank and 2cp-1-rank of each unit (units end at
    `boundaries`, [0, ..., total], each a multiple of 2cp long: Transformer Engine's thd partitioning), as indices
    into the whole row, and their attention blocks: the part of each of the whole row's `blocks` (`own_start` ==
    `query_start`) that falls in a chunk, its earlier rows joining its prefix."""
    rows: list[torch.Tensor] = []
    shard: list[AttentionBlock] = []
    held = 0
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        chunk = (end - start) // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            low, high = start + index * chunk, start + (index + 1) * chunk
            for block in blocks:
                first, last = max(block.query_start, low), min(block.query_end, high)
                if first < last:
                    prefix = _merge_ranges([*block.prefix, (block.own_start, first)])
                    shard.append(AttentionBlock(held + first - low, held + last - low, first, prefix))
            rows.append(torch.arange(low, high))
            held += chunk
    return torch.cat(rows), shard
