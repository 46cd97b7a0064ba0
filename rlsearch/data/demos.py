"""Demonstration trajectories for supervised warm starts: chat rows that search, read and answer.

A demonstration is what a good search agent would do on a toy question, written as the rollout would write it:
the user turn is the protocol's instruction, the first assistant turn searches for the question's entity, the tool
turn is the observation the local retriever gives for that query (rendered by the same protocol code the agent
loop uses), and the last assistant turn answers with the first golden answer. A controllable fraction is flawed,
so that a model fine-tuned on them answers only part of the questions right and reinforcement learning has room
to improve:
- ``guess``: answers at once without searching, naming the question's entity (never the answer);
- ``misread``: searches and reads like a good demonstration, then answers with the entity's name.

Rows are ``{"id", "messages": [{"role", "content"}, ...], "flawed": null | "guess" | "misread"}`` (roles user,
assistant, tool), the format `rlsearch sft` reads.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .toy import ToyDataPaths, make_toy_data

FLAW_KINDS = ("guess", "misread")

# (queries, topk) -> per query the retrieved passages as {"id", "contents"} rows, best first
SearchFunction = Callable[[list[str], int], list[list[dict]]]


@dataclass(frozen=True)
class DemoStats:
    path: Path
    rows: int
    flawed: int


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def demonstration(
    question: str, entity: str, answer: str, observation: str, instruction: str, flaw: str | None
) -> list[dict[str, str]]:
    """The chat messages of one demonstration (``flaw``: None for a good one, else one of FLAW_KINDS)."""
    user = _turn("user", instruction)
    if flaw == "guess":
        return [user, _turn("assistant", f"<answer> {entity} </answer>")]
    final = entity if flaw == "misread" else answer
    return [
        user,
        _turn("assistant", f"<search> {entity} </search>"),
        _turn("tool", observation),
        _turn("assistant", f"<answer> {final} </answer>"),
    ]


def write_demonstrations(
    qa_path: str | os.PathLike,
    out_path: str | os.PathLike,
    search: SearchFunction,
    topk: int,
    flawed_fraction: float = 0.0,
    seed: int = 0,
    protocol_name: str = "search_r1",
    prompt_file: str | os.PathLike | None = None,
    append: bool = False,
) -> DemoStats:
    """One demonstration per row of ``qa_path`` (toy rows: ``metadata.entity`` names what to search for).

    ``search`` is the retriever the agent will use (the local BM25 index over the toy corpus), queried with the
    entity at ``topk`` so that the observation is the one a rollout would see. Exactly
    round(rows * flawed_fraction) demonstrations are flawed, chosen and given a kind by ``seed``. ``prompt_file``:
    the instruction's prompt YAML (as rollout.prompt_file; default the protocol's). ``append``: add to ``out_path``.
    """
    from ..tools import Document
    from ..tools.protocols import SearchR1Protocol

    if protocol_name != SearchR1Protocol.name:
        raise ValueError(f"demonstrations are written for the search_r1 protocol only, not '{protocol_name}'")
    if not 0.0 <= flawed_fraction <= 1.0:
        raise ValueError(f"flawed_fraction must be within [0, 1], got {flawed_fraction}")
    rows = [json.loads(line) for line in Path(qa_path).read_text(encoding="utf-8").splitlines() if line.strip()]
    missing = [row.get("id") for row in rows if "entity" not in (row.get("metadata") or {})]
    if missing:
        raise ValueError(
            f"{qa_path}: rows without metadata.entity (e.g. {missing[0]}); demonstrations need toy rows written by "
            "`rlsearch make-toy-data`"
        )
    protocol = SearchR1Protocol(prompt_file=prompt_file)
    entities = [row["metadata"]["entity"] for row in rows]
    retrieved = search(entities, topk)
    rng = random.Random(seed)
    flawed = set(rng.sample(range(len(rows)), round(len(rows) * flawed_fraction)))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a" if append else "w", encoding="utf-8") as file:
        for index, (row, entity, passages) in enumerate(zip(rows, entities, retrieved)):
            flaw = rng.choice(FLAW_KINDS) if index in flawed else None
            observation = protocol.observation([Document.from_passage(p["contents"], str(p["id"])) for p in passages])
            messages = demonstration(
                row["question"], entity, row["golden_answers"][0], observation, protocol.instruction(row["question"]),
                flaw,
            )
            file.write(json.dumps({"id": row["id"], "messages": messages, "flawed": flaw}, ensure_ascii=False) + "\n")
    return DemoStats(out, len(rows), len(flawed))


def write_toy_demonstrations(
    toy: ToyDataPaths,
    out_path: str | os.PathLike,
    topk: int,
    flawed_fraction: float,
    seed: int,
    extra_corpora: int = 0,
    prompt_file: str | os.PathLike | None = None,
    **toy_options: Any,
) -> DemoStats:
    """Demonstrations for ``toy.train`` (over ``toy.corpus``), then for the train questions of ``extra_corpora``
    more toy datasets made with ``toy_options`` and seeds drawn from ``seed``.

    A demonstration carries its observation, so the extra corpora are thrown away once written: they multiply the
    demonstrations without touching the test questions (other seeds invent other facts, with the same name tokens
    under a learnable ``name_pool``), which is what a small model needs to learn to copy rather than to memorise.
    """
    stats = write_demonstrations(toy.train, out_path, bm25_search(toy.corpus), topk, flawed_fraction, seed,
                                 prompt_file=prompt_file)
    rows, flawed = stats.rows, stats.flawed
    extra_seeds = random.Random(f"demo-corpora-{seed}").sample(range(10**6, 10**9), extra_corpora)
    with tempfile.TemporaryDirectory(prefix="rlsearch-demo-corpora-") as scratch:
        for extra_seed in extra_seeds:
            extra = make_toy_data(Path(scratch) / str(extra_seed), seed=extra_seed, **toy_options)
            more = write_demonstrations(extra.train, out_path, bm25_search(extra.corpus), topk, flawed_fraction,
                                        extra_seed, prompt_file=prompt_file, append=True)
            rows, flawed = rows + more.rows, flawed + more.flawed
    return DemoStats(stats.path, rows, flawed)


def bm25_search(corpus_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> SearchFunction:
    """The local retriever's BM25 index as a SearchFunction (the same index the retrieval server builds)."""
    from ..tools.servers.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(corpus_path, cache_dir)

    def search(queries: Sequence[str], topk: int) -> list[list[dict]]:
        return [[document for document, _ in hits] for hits in retriever.search(list(queries), topk)]

    return search
