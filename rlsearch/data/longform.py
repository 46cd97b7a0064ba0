"""A long-form task over the toy corpus, scored by rubrics: each question asks for a short report that gathers k
facts from k different passages and cites them, and carries one rubric per fact, so evolving rubrics
(reward.rubric.evolve) can be tried offline.

The corpus is the toy task's (`generate_entities`: invented towns, inventors, rivers and inventions, each with
look-alike passages that mention it with facts of their own). A question takes k of its question entities, asks one
fact of each, and tells the agent to cite each fact's passage as ``<cite id="ID">`` (the ids the call_tool protocol
shows as ``<snippet id=ID>``). Its rubrics, in rlsearch's own form:

- per fact, weight 1: the answer gives the fact and cites the passage it comes from. The judge's 0-2 scale reads
  naturally: 2 the fact with its citation, 1 the fact alone, 0 neither;
- per fact with a look-alike, weight -1 (a pitfall): the answer gives the look-alike's fact instead (what a search
  that ranks the look-alike first would lead to), which subtracts.
"""

from __future__ import annotations

import os
import random

from .toy import Entity, Question, ToyDataPaths, generate_entities, write_toy_data

DATA_SOURCE = "longform"  # scored by the rubric scorer by default (rlsearch.reward.registry.DEFAULT_SCORERS)
FACT_WEIGHT, PITFALL_WEIGHT = 1.0, -1.0


def make_longform_data(
    out_dir: str | os.PathLike,
    seed: int = 0,
    num_questions: int = 60,
    facts_per_question: int = 3,
    test_fraction: float = 0.2,
    distractors_per_entity: int = 1,
) -> ToyDataPaths:
    """Write corpus.jsonl, train.jsonl, test.jsonl and README.txt to ``out_dir``; same seed, same bytes.

    ``num_questions`` questions of ``facts_per_question`` facts each, every fact about its own entity (so its own
    passage); ``distractors_per_entity`` look-alike passages per entity, each giving a pitfall rubric (the first
    look-alike's). Rows: ``{"id", "question", "data_source": "longform", "rubrics": [{"text", "weight"}],
    "metadata": {"entities": [the k titles], "passage_ids": [their passages' ids], "answers": [each fact's
    answer]}}``; no golden answers.
    """
    _check_arguments(num_questions, facts_per_question, test_fraction, distractors_per_entity)
    rng = random.Random(seed)
    passages, asked = generate_entities(rng, num_questions * facts_per_question, distractors_per_entity)
    rng.shuffle(passages)
    passage_ids = {passage.title: str(index) for index, passage in enumerate(passages)}
    rows = [_row(f"{DATA_SOURCE}-{index}", asked[index * facts_per_question:(index + 1) * facts_per_question],
                 passage_ids) for index in range(num_questions)]
    rng.shuffle(rows)
    num_test = min(num_questions - 1, max(1, round(num_questions * test_fraction)))
    readme = _readme(seed, num_questions, facts_per_question, len(passages), num_test, distractors_per_entity)
    return write_toy_data(out_dir, passages, passage_ids, rows, num_test, readme)


def _row(row_id: str, facts: list[tuple[Entity, Question, list[Entity]]], passage_ids: dict[str, str]) -> dict:
    titles = [entity.passage.title for entity, _, _ in facts]
    asked = " ".join(question.question for _, question, _ in facts)
    rubrics = []
    for entity, question, distractors in facts:
        passage_id = passage_ids[entity.passage.title]
        rubrics.append({"text": f'Answers "{question.question}" with {question.golden_answers[0]} and cites the '
                                f'passage that says so, <cite id="{passage_id}">.', "weight": FACT_WEIGHT})
        if distractors:
            wrong = _same_fact(distractors[0], entity, question)
            rubrics.append({"text": f'Answers "{question.question}" with {wrong}, a fact of '
                                    f"{distractors[0].passage.title} (a passage that only mentions "
                                    f"{entity.passage.title}).", "weight": PITFALL_WEIGHT})
    return {
        "id": row_id,
        "question": f"Write a short report on {_listed(titles)} that answers these questions: {asked} Cite the "
                    'passage of each fact as <cite id="ID">, with the id the search result shows.',
        "data_source": DATA_SOURCE,
        "rubrics": rubrics,
        "metadata": {"entities": titles, "passage_ids": [passage_ids[title] for title in titles],
                     "answers": [question.golden_answers[0] for _, question, _ in facts]},
    }


def _same_fact(distractor: Entity, entity: Entity, question: Question) -> str:
    """The distractor's answer to the question ``entity`` was asked (entities of a kind ask their facts alike)."""
    return distractor.questions[entity.questions.index(question)].golden_answers[0]


def _listed(titles: list[str]) -> str:
    return titles[0] if len(titles) == 1 else f"{', '.join(titles[:-1])} and {titles[-1]}"


def _check_arguments(num_questions: int, facts_per_question: int, test_fraction: float,
                     distractors_per_entity: int) -> None:
    if num_questions < 2:
        raise ValueError(f"num_questions must be at least 2 (one train and one test question), got {num_questions}")
    if facts_per_question < 1:
        raise ValueError(f"facts_per_question must be at least 1, got {facts_per_question}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be strictly between 0 and 1, got {test_fraction}")
    if distractors_per_entity < 0:
        raise ValueError(f"distractors_per_entity must be >= 0, got {distractors_per_entity}")


def _readme(seed: int, num_questions: int, facts: int, num_passages: int, num_test: int, distractors: int) -> str:
    pitfalls = (" and, per fact, a pitfall rubric of weight -1: the fact of a look-alike passage given instead"
                if distractors else "")
    return (
        f"Long-form QA data made by rlsearch.data.make_longform_data (seed {seed}). corpus.jsonl holds {num_passages} "
        'passages in the Search-R1 corpus format {"id", "contents"} (the toy task\'s invented towns, inventors, '
        f"rivers and inventions, {distractors} look-alike passage(s) per entity). train.jsonl "
        f"({num_questions - num_test} rows) and test.jsonl ({num_test} rows) hold questions that each ask for a "
        f"short report on {facts} entities, one fact of each from its own passage, citing the passages as "
        '<cite id="ID">. Rows are {"id", "question", "data_source": "longform", "rubrics", "metadata": {"entities", '
        '"passage_ids", "answers"}} with no golden answers: the rubric scorer judges each answer on its rubrics, '
        f"one per fact of weight 1 (the fact and its citation){pitfalls}.\n"
    )

