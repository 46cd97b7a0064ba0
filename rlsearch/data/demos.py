"""Demonstration trajectories for supervised warm starts: chat rows that search, read and answer.

A demonstration is what a good search agent would do on a toy or multihop question, written as the rollout would
write it: the prompt is the protocol's (search_r1 or call_tool: its system message, if any, and its instruction), then
an assistant turn searches for an entity and the tool turn is the observation the local retriever gives for that
query (rendered by the same protocol code the agent loop uses), once per entity to look up (a toy question's one
entity, each entity of a multihop chain in order), and the last assistant turn answers with the first golden answer.
A controllable fraction is flawed, so that a model fine-tuned on them answers only part of the questions right and
reinforcement learning has room to improve:
- ``guess``: answers at once without searching, naming the question's entity (never the answer);
- ``misread``: searches and reads like a good demonstration, then answers with the name it searched for last.

A share of the good multihop demonstrations can fold (``fold_fraction``), to warm a model up for rollout.context
fold: after some searches the context is folded as the agent loop folds it (the fold instruction as an observation, a
summary turn naming the chain's facts read so far), and the demonstration goes on from the folded question as a row
of its own; each segment is a row.

Rows are ``{"id", "messages": [{"role", "content"}, ...], "flawed": null | "guess" | "misread"}`` (roles system,
user, assistant, tool), the format `rlsearch sft` reads.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tools.protocols.folding import FOLD_INSTRUCTION, FOLDED_QUESTION, SUMMARY_CLOSE, SUMMARY_OPEN
from .multihop import chain_fact
from .toy import ToyDataPaths, make_toy_data

FLAW_KINDS = ("guess", "misread")
# the assistant turn that searches for a query, in each tag protocol demonstrations are written for
SEARCH_CALLS = {"search_r1": "<search> {query} </search>", "call_tool": '<call_tool name="search">{query}</call_tool>'}

# (queries, topk) -> per query the retrieved passages as {"id", "contents"} rows, best first
SearchFunction = Callable[[list[str], int], list[list[dict]]]


@dataclass(frozen=True)
class DemoStats:
    path: Path
    rows: int  # lines written: one per demonstration, one per segment of a folding one
    flawed: int
    folded: int = 0


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def demonstration(
    prompt: Sequence[dict[str, str]], queries: Sequence[str], observations: Sequence[str], answer: str,
    flaw: str | None, search_call: str = SEARCH_CALLS["search_r1"],
) -> list[dict[str, str]]:
    """The chat messages of one demonstration: the ``prompt`` messages, then per query a ``search_call`` turn (its
    ``{query}`` filled in) and the observation, then the answer (``flaw``: None for a good one, else one of
    FLAW_KINDS)."""
    if flaw == "guess":
        return [*prompt, _turn("assistant", f"<answer> {queries[0]} </answer>")]
    messages = list(prompt)
    for query, observation in zip(queries, observations, strict=True):
        messages += [_turn("assistant", search_call.format(query=query)), _turn("tool", observation)]
    final = queries[-1] if flaw == "misread" else answer
    return [*messages, _turn("assistant", f"<answer> {final} </answer>")]


def fold_demonstration(
    prompt_of: Callable[[str], list[dict[str, str]]], question: str, queries: Sequence[str],
    observations: Sequence[str], facts: Sequence[str], answer: str, fold_after: Collection[int], fold_notice: str,
    search_call: str = SEARCH_CALLS["search_r1"],
) -> list[list[dict[str, str]]]:
    """A good demonstration whose context folds after each search numbered in ``fold_after`` (1 to k), one message
    list per segment: ``fold_notice`` (the fold instruction as the protocol wraps an observation) asks for a summary,
    the summary turn lists ``facts[:n]`` (what n searches found), and the next segment starts from ``prompt_of`` the
    question folded with that summary, as the agent loop goes on."""
    segments, messages = [], prompt_of(question)
    for number, (query, observation) in enumerate(zip(queries, observations, strict=True), start=1):
        messages += [_turn("assistant", search_call.format(query=query)), _turn("tool", observation)]
        if number in fold_after:
            summary = " ".join(facts[:number])
            segments.append([*messages, _turn("tool", fold_notice),
                             _turn("assistant", f"{SUMMARY_OPEN} {summary} {SUMMARY_CLOSE}")])
            messages = prompt_of(FOLDED_QUESTION.format(question=question, summary=summary))
    return [*segments, [*messages, _turn("assistant", f"<answer> {answer} </answer>")]]


def _fold_points(rng: random.Random, hops: int) -> set[int]:
    """After which searches (1 to hops) a folding demonstration folds: each with probability 1/2, at least one."""
    return {number for number in range(1, hops + 1) if rng.random() < 0.5} or {rng.randint(1, hops)}


def search_queries(row: dict) -> list[str]:
    """What a good agent searches for, in order: a multihop row's ``metadata.chain``, a toy row's
    ``metadata.entity``; empty for other rows."""
    metadata = row.get("metadata") or {}
    if metadata.get("chain"):
        return [str(entity) for entity in metadata["chain"]]
    return [str(metadata["entity"])] if "entity" in metadata else []


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
    fold_fraction: float = 0.0,
) -> DemoStats:
    """One demonstration per row of ``qa_path`` (toy or multihop rows: see `search_queries`).

    ``search`` is the retriever the agent will use (the local BM25 index over the corpus), queried with each entity
    at ``topk`` so that the observations are the ones a rollout would see. ``protocol_name``: the tag format,
    search_r1 or call_tool (whose system message lists the search tool). Exactly round(rows * flawed_fraction)
    demonstrations are flawed, chosen and given a kind by ``seed``. ``prompt_file``: the prompt YAML (as
    rollout.prompt_file; default the protocol's). ``append``: add to ``out_path``. ``fold_fraction``: the share of
    the good demonstrations of multihop rows that fold (`fold_demonstration`), chosen with their fold points by
    ``seed``; a row whose searches miss a fact it would summarise stays unfolded.
    """
    from ..tools import Document, ToolSpec, make_protocol
    from ..tools.search_api import SEARCH_DESCRIPTION

    if protocol_name not in SEARCH_CALLS:
        raise ValueError(
            f"demonstrations are written for the {' and '.join(SEARCH_CALLS)} protocols only, not '{protocol_name}'"
        )
    for name, fraction in (("flawed_fraction", flawed_fraction), ("fold_fraction", fold_fraction)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} must be within [0, 1], got {fraction}")
    rows = [json.loads(line) for line in Path(qa_path).read_text(encoding="utf-8").splitlines() if line.strip()]
    queries = [search_queries(row) for row in rows]
    missing = [row.get("id") for row, row_queries in zip(rows, queries) if not row_queries]
    if missing:
        raise ValueError(
            f"{qa_path}: rows without metadata.entity or metadata.chain (e.g. {missing[0]}); demonstrations need toy "
            "or multihop rows written by `rlsearch make-toy-data`"
        )
    # the tool the rollout's search calls reach (SearchTool's name and description), for a prompt that lists tools
    protocol = make_protocol(protocol_name, [ToolSpec("search", SEARCH_DESCRIPTION)], str(prompt_file or ""))
    system = protocol.system_prompt()
    hits = iter(search([query for row_queries in queries for query in row_queries], topk))
    rng = random.Random(seed)
    flawed = set(rng.sample(range(len(rows)), round(len(rows) * flawed_fraction)))
    good = [index for index in range(len(rows)) if index not in flawed]
    fold_rng = random.Random(f"fold-{seed}")  # its own stream: without folds the file is what it always was
    folding = set(fold_rng.sample(good, round(len(good) * fold_fraction))) if fold_fraction else set()

    def prompt_of(question: str) -> list[dict[str, str]]:
        return [*([_turn("system", system)] if system else []), _turn("user", protocol.instruction(question))]

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = folded = 0
    with out.open("a" if append else "w", encoding="utf-8") as file:
        for index, (row, row_queries) in enumerate(zip(rows, queries)):
            flaw = rng.choice(FLAW_KINDS) if index in flawed else None
            observations = [
                protocol.observation([Document.from_passage(p["contents"], str(p["id"])) for p in next(hits)])
                for _ in row_queries
            ]
            facts = [chain_fact(observation, query) for query, observation in zip(row_queries, observations)]
            if index in folding and all(facts):
                segments = fold_demonstration(
                    prompt_of, row["question"], row_queries, observations, facts, row["golden_answers"][0],
                    _fold_points(fold_rng, len(row_queries)), protocol.wrap(FOLD_INSTRUCTION),
                    SEARCH_CALLS[protocol_name],
                )
                folded += 1
                ids = [f"{row['id']}-segment-{number}" for number in range(1, len(segments) + 1)]
            else:
                segments = [demonstration(prompt_of(row["question"]), row_queries, observations,
                                          row["golden_answers"][0], flaw, SEARCH_CALLS[protocol_name])]
                ids = [row["id"]]
            for row_id, messages in zip(ids, segments):
                file.write(json.dumps({"id": row_id, "messages": messages, "flawed": flaw}, ensure_ascii=False) + "\n")
            lines += len(segments)
    return DemoStats(out, lines, len(flawed), folded)


def write_toy_demonstrations(
    toy: ToyDataPaths,
    out_path: str | os.PathLike,
    topk: int,
    flawed_fraction: float,
    seed: int,
    extra_corpora: int = 0,
    prompt_file: str | os.PathLike | None = None,
    protocol_name: str = "search_r1",
    make_data: Callable[..., ToyDataPaths] = make_toy_data,
    fold_fraction: float = 0.0,
    **toy_options: Any,
) -> DemoStats:
    """Demonstrations for ``toy.train`` (over ``toy.corpus``), then for the train questions of ``extra_corpora``
    more datasets made by ``make_data`` (make_toy_data, or make_multihop_data) with ``toy_options`` and seeds drawn
    from ``seed``.

    A demonstration carries its observation, so the extra corpora are thrown away once written: they multiply the
    demonstrations without touching the test questions (other seeds invent other facts, with the same name tokens
    under a learnable ``name_pool``), which is what a small model needs to learn to copy rather than to memorise.
    """
    stats = write_demonstrations(toy.train, out_path, bm25_search(toy.corpus), topk, flawed_fraction, seed,
                                 protocol_name, prompt_file, fold_fraction=fold_fraction)
    rows, flawed, folded = stats.rows, stats.flawed, stats.folded
    extra_seeds = random.Random(f"demo-corpora-{seed}").sample(range(10**6, 10**9), extra_corpora)
    with tempfile.TemporaryDirectory(prefix="rlsearch-demo-corpora-") as scratch:
        for extra_seed in extra_seeds:
            extra = make_data(Path(scratch) / str(extra_seed), seed=extra_seed, **toy_options)
            more = write_demonstrations(extra.train, out_path, bm25_search(extra.corpus), topk, flawed_fraction,
                                        extra_seed, protocol_name, prompt_file, append=True,
                                        fold_fraction=fold_fraction)
            rows, flawed, folded = rows + more.rows, flawed + more.flawed, folded + more.folded
    return DemoStats(stats.path, rows, flawed, folded)


def bm25_search(corpus_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> SearchFunction:
    """The local retriever's BM25 index as a SearchFunction (the same index the retrieval server builds)."""
    from ..tools.servers.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(corpus_path, cache_dir)

    def search(queries: Sequence[str], topk: int) -> list[list[dict]]:
        return [[document for document, _ in hits] for hits in retriever.search(list(queries), topk)]

    return search
