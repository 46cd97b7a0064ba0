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

Rows are ``{"id", "messages": [{"role", "content"}, ...], "flawed": null | "guess" | "misread"}`` (roles system,
user, assistant, tool), the format `rlsearch sft` reads.
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
# the assistant turn that searches for a query, in each tag protocol demonstrations are written for
SEARCH_CALLS = {"search_r1": "<search> {query} </search>", "call_tool": '<call_tool name="search">{query}</call_tool>'}

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
) -> DemoStats:
    """One demonstration per row of ``qa_path`` (toy or multihop rows: see `search_queries`).

    ``search`` is the retriever the agent will use (the local BM25 index over the corpus), queried with each entity
    at ``topk`` so that the observations are the ones a rollout would see. ``protocol_name``: the tag format,
    search_r1 or call_tool (whose system message lists the search tool). Exactly round(rows * flawed_fraction)
    demonstrations are flawed, chosen and given a kind by ``seed``. ``prompt_file``: the prompt YAML (as
    rollout.prompt_file; default the protocol's). ``append``: add to ``out_path``.
    """
    from ..tools import Document, ToolSpec, make_protocol
    from ..tools.search_api import SEARCH_DESCRIPTION

    if protocol_name not in SEARCH_CALLS:
        raise ValueError(
            f"demonstrations are written for the {' and '.join(SEARCH_CALLS)} protocols only, not '{protocol_name}'"
        )
    if not 0.0 <= flawed_fraction <= 1.0:
        raise ValueError(f"flawed_fraction must be within [0, 1], got {flawed_fraction}")
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
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a" if append else "w", encoding="utf-8") as file:
        for index, (row, row_queries) in enumerate(zip(rows, queries)):
            flaw = rng.choice(FLAW_KINDS) if index in flawed else None
            observations = [
                protocol.observation([Document.from_passage(p["contents"], str(p["id"])) for p in next(hits)])
                for _ in row_queries
            ]
            prompt = [_turn("system", system)] if system else []
            prompt.append(_turn("user", protocol.instruction(row["question"])))
            messages = demonstration(prompt, row_queries, observations, row["golden_answers"][0], flaw,
                                     SEARCH_CALLS[protocol_name])
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
    protocol_name: str = "search_r1",
    make_data: Callable[..., ToyDataPaths] = make_toy_data,
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
                                 protocol_name, prompt_file)
    rows, flawed = stats.rows, stats.flawed
    extra_seeds = random.Random(f"demo-corpora-{seed}").sample(range(10**6, 10**9), extra_corpora)
    with tempfile.TemporaryDirectory(prefix="rlsearch-demo-corpora-") as scratch:
        for extra_seed in extra_seeds:
            extra = make_data(Path(scratch) / str(extra_seed), seed=extra_seed, **toy_options)
            more = write_demonstrations(extra.train, out_path, bm25_search(extra.corpus), topk, flawed_fraction,
                                        extra_seed, protocol_name, prompt_file, append=True)
            rows, flawed = rows + more.rows, flawed + more.flawed
    return DemoStats(stats.path, rows, flawed)


def bm25_search(corpus_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> SearchFunction:
    """The local retriever's BM25 index as a SearchFunction (the same index the retrieval server builds)."""
    from ..tools.servers.retrieval import BM25Retriever

    retriever = BM25Retriever.from_corpus(corpus_path, cache_dir)

    def search(queries: Sequence[str], topk: int) -> list[list[dict]]:
        return [[document for document, _ in hits] for hits in retriever.search(list(queries), topk)]

    return search
