"""Loading QA datasets from JSONL or Parquet files: Search-R1 raw or processed rows, and long-form rows whose rubrics
come in rlsearch's own ``rubrics``, DR Tulu's ``ground_truth`` or RaR's ``rubric`` form (docs/data.md)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACCEPTED_SUFFIXES = (".jsonl", ".parquet")
# A question longer than this is an error at load time, naming its row. Search-R1 questions are well under 1,000
# characters; 32,768 characters of English are ~8k tokens, more than any prompt budget (rollout.max_prompt_tokens,
# 512 by default) is meant to hold. The check needs no tokenizer, so it runs before anything starts and a runaway row
# (a document pasted into the question field) stops the run at once instead of when its batch comes up; questions
# under it whose prompt is still over rollout.max_prompt_tokens are reported when the prompt is built.
MAX_QUESTION_CHARS = 32_768
GENERAL_RUBRIC = "general_rubric"  # DR Tulu's `dataset` (its verifier) of a rubric row
RUBRIC_SCORER = "rubric"  # the scorer DR Tulu's and RaR's rows imply


@dataclass(frozen=True)
class Rubric:
    """One criterion of a long-form answer (the rubric scorer): judged on its own, weighted in the score. A negative
    weight marks a pitfall: meeting it subtracts."""

    text: str
    weight: float = 1.0


@dataclass(frozen=True)
class QAExample:
    id: str
    question: str
    golden_answers: tuple[str, ...]  # empty only in rows that carry rubrics
    data_source: str
    scorer: str = ""  # the row's own scorer name (AgentRL rows); wins over reward.scorers for this row
    turn_scorer: str = ""  # the row's own turn scorer (turn-level credit); wins over reward.turn_scorers
    rubrics: tuple[Rubric, ...] = ()
    hops: int = 0  # a multi-hop row's metadata.hops (the searches it takes); 0: none. Eval tables break down by it
    location: str = field(default="", compare=False)  # file:line (or file: row N), for errors naming the row


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or has a malformed row; the message says where and what to fix."""


def load_qa_dataset(
    path: str | os.PathLike, default_data_source: str = "unknown", max_question_chars: int = MAX_QUESTION_CHARS
) -> list[QAExample]:
    """Read QA examples from a ``.jsonl`` (UTF-8) or ``.parquet`` file.

    Rows are either raw Search-R1 rows (``question``, ``golden_answers``) or processed ones whose answers
    live in ``reward_model.ground_truth.target`` and whose question may be in ``extra_info.question``. Optional:
    ``scorer`` (a scorer name for this row), ``turn_scorer`` (its turn scorer, for turn-level credit) and rubrics
    in one of three forms (a row with rubrics needs no golden answers): rlsearch's ``rubrics`` (``[{"text",
    "weight"}]``), DR Tulu's ``ground_truth`` (JSON ``{"query", "rubrics": [{"description", "title", "weight"}]}``;
    its question is ``query`` when the row has no ``question``) or RaR's ``rubric`` (``[{"description", "title",
    "weight"}]``). DR Tulu's and RaR's rows are scored by the rubric scorer unless they name a ``scorer``.
    An empty file, a malformed row, bytes that are not UTF-8 and a question over ``max_question_chars`` characters
    are `DatasetError`s naming the file (and line or row).
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    if path.suffix == ".jsonl":
        located_rows = _read_jsonl(path)
    elif path.suffix == ".parquet":
        located_rows = _read_parquet(path)
    else:
        raise DatasetError(
            f"{path}: unsupported file type; accepted suffixes are {', '.join(ACCEPTED_SUFFIXES)}"
        )

    examples = [
        _parse_row(row, location, f"{path.stem}-{index}", default_data_source, max_question_chars)
        for index, (location, row) in enumerate(located_rows)
    ]
    if not examples:
        raise DatasetError(f"{path} contains no rows (the file is empty or has only blank lines)")
    return examples


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as lines:  # decoded line by line, so bytes that are not UTF-8 are reported with their line
        for line_number, raw in enumerate(lines, start=1):
            location = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DatasetError(
                    f"{location}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte offset {error.start} of the "
                    f"line); the file must be UTF-8 encoded, e.g. convert it with iconv -f <its encoding> -t UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(
                    f"{location}: invalid JSON ({error.msg}); each line must be one JSON object"
                ) from error


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except pyarrow.ArrowException as error:
        raise DatasetError(f"{path}: not a readable parquet file ({error})") from error
    for row_number, row in enumerate(rows, start=1):
        yield f"{path}: row {row_number}", row


def _parse_row(
    row: Any, location: str, fallback_id: str, default_data_source: str, max_question_chars: int
) -> QAExample:
    if not isinstance(row, dict):
        raise DatasetError(f"{location}: expected a JSON object, got {type(row).__name__}")
    row_id = row.get("id")
    rubrics = _row_rubrics(row, location)
    data_source = row.get("data_source", rubrics.data_source)
    return QAExample(
        id=fallback_id if row_id is None else str(row_id),
        question=_parse_question(row, location, max_question_chars, rubrics.question),
        golden_answers=_parse_golden_answers(row, location, required=not rubrics.rubrics),
        data_source=default_data_source if data_source is None else str(data_source),
        scorer=_parse_scorer(row.get("scorer"), location) or rubrics.scorer,
        turn_scorer=_parse_scorer(row.get("turn_scorer"), location, "turn_scorer", "retrieved_answer, new_information"),
        rubrics=rubrics.rubrics,
        hops=_parse_hops(row.get("metadata")),
        location=location,
    )


def _parse_hops(metadata: Any) -> int:
    """``metadata.hops`` when it is a whole number > 0 (multihop rows), else 0; other metadata is not read."""
    hops = metadata.get("hops") if isinstance(metadata, dict) else None
    return hops if isinstance(hops, int) and not isinstance(hops, bool) and hops > 0 else 0


def _parse_scorer(scorer: Any, location: str, key: str = "scorer", examples: str = "em, f1, judge, rubric") -> str:
    if scorer is None:
        return ""
    if not isinstance(scorer, str) or not scorer.strip():
        raise DatasetError(f"{location}: '{key}' must be a scorer name (e.g. {examples}); got {scorer!r}")
    return scorer.strip()


@dataclass(frozen=True)
class _RowRubrics:
    rubrics: tuple[Rubric, ...] = ()
    question: str | None = None  # DR Tulu's ground_truth query
    scorer: str = ""  # the scorer the row's form implies (DR Tulu's and RaR's: rubric)
    data_source: Any = None  # DR Tulu's name of the row's dataset, `source`


def _row_rubrics(row: dict[str, Any], location: str) -> _RowRubrics:
    """The row's rubrics in whichever of the three forms it gives (more than one is an error)."""
    ground_truth = _dr_tulu_ground_truth(row, location)
    given = [key for key in ("rubrics", "rubric") if row.get(key) is not None]
    given += ["ground_truth"] if ground_truth is not None else []
    if len(given) > 1:
        raise DatasetError(f"{location}: the row gives rubrics as {' and '.join(map(repr, given))}; keep one")
    if row.get("rubrics") is not None:
        return _RowRubrics(_parse_rubrics(row["rubrics"], f"{location}: rubrics", "text"))
    if row.get("rubric") is not None:  # RaR
        return _RowRubrics(_parse_rubrics(row["rubric"], f"{location}: rubric", "description"), scorer=RUBRIC_SCORER)
    if ground_truth is not None:
        query = ground_truth.get("query", ground_truth.get("Question"))
        rubrics = _parse_rubrics(ground_truth.get("rubrics"), f"{location}: ground_truth.rubrics", "description")
        return _RowRubrics(rubrics, query if isinstance(query, str) else None, RUBRIC_SCORER, row.get("source"))
    return _RowRubrics()


def _dr_tulu_ground_truth(row: dict[str, Any], location: str) -> dict[str, Any] | None:
    """DR Tulu's rubric ground truth: ``ground_truth`` as a JSON string (as DR Tulu writes it; open-instruct may wrap
    it in a one-item list) or an object, holding ``rubrics``. None for a row without one; a ``general_rubric`` row
    whose ground truth holds no rubrics is an error."""
    value = row.get("ground_truth")
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, dict) and "rubrics" in value:
        return value
    if row.get("dataset") == GENERAL_RUBRIC:
        raise DatasetError(
            f"{location}: 'ground_truth' of a {GENERAL_RUBRIC} row must be a JSON object with 'query' and 'rubrics' "
            f"(as DR Tulu writes it: json.dumps({{\"query\": ..., \"rubrics\": [...]}})); got {_short(value)}"
        )
    return None


def _parse_rubrics(rubrics: Any, where: str, text_key: str) -> tuple[Rubric, ...]:
    """A non-empty list of objects with the criterion under ``text_key`` (rlsearch's "text"; DR Tulu's and RaR's
    "description", where "title" and any other key are left out) and a "weight"; at least one weight > 0."""
    shape = f'{{"{text_key}", "weight"}}'
    if not isinstance(rubrics, (list, tuple)) or not rubrics:
        raise DatasetError(f"{where}: must be a non-empty list of {shape} objects; got {_short(rubrics)}")
    parsed = tuple(_parse_rubric(rubric, f"{where}[{index}]", text_key) for index, rubric in enumerate(rubrics))
    if not any(rubric.weight > 0 for rubric in parsed):
        raise DatasetError(f"{where}: no rubric has a positive weight; give at least one (the score is divided by "
                           "the sum of the positive weights)")
    return parsed


def _parse_rubric(rubric: Any, where: str, text_key: str) -> Rubric:
    if not isinstance(rubric, dict):
        raise DatasetError(f'{where}: expected an object {{"{text_key}": ..., "weight": ...}}, got {_short(rubric)}')
    if text_key == "text":
        unknown = sorted(set(rubric) - {"text", "weight"})
        if unknown:
            raise DatasetError(f"{where}: unknown key {unknown[0]!r}; a rubric has 'text' and 'weight'")
    text = rubric.get(text_key)
    if not isinstance(text, str) or not text.strip():
        raise DatasetError(f"{where}: missing or empty '{text_key}'; give the criterion as a non-empty string")
    weight = rubric.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight == 0:
        raise DatasetError(f"{where}: 'weight' must be a number other than 0 (a negative one marks a pitfall, which "
                           f"subtracts when the answer meets it); got {weight!r}")
    return Rubric(text=text.strip(), weight=float(weight))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _parse_question(row: dict[str, Any], location: str, max_chars: int, ground_truth_query: str | None) -> str:
    question = row.get("question")
    extra_info = row.get("extra_info")
    if question is None and isinstance(extra_info, dict):
        question = extra_info.get("question")
    if question is None:
        question = ground_truth_query
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(
            f"{location}: missing or empty 'question' (or 'extra_info.question', or the 'query' of DR Tulu's "
            "'ground_truth'); give a non-empty string"
        )
    question = question.strip()
    if len(question) > max_chars:
        raise DatasetError(
            f"{location}: the question has {len(question):,} characters, more than the limit of {max_chars:,} "
            f"(rlsearch.data.dataset.MAX_QUESTION_CHARS); a question that long cannot fit the prompt budget "
            f"(rollout.max_prompt_tokens): shorten or drop the row"
        )
    return question


def _parse_golden_answers(row: dict[str, Any], location: str, required: bool) -> tuple[str, ...]:
    answers = row.get("golden_answers")
    if answers is None:
        answers = _processed_target(row)
    if answers is None and not required:
        return ()
    if answers is None:
        raise DatasetError(
            f"{location}: missing golden answers; give 'golden_answers' or 'reward_model.ground_truth.target' "
            "(or rubrics, for the rubric scorer: see docs/data.md)"
        )
    if isinstance(answers, str):
        return (answers,)
    if not isinstance(answers, (list, tuple)):
        raise DatasetError(f"{location}: golden answers must be a string or a list of strings")
    if not answers:
        raise DatasetError(f"{location}: empty list of golden answers; give at least one answer")
    if not all(isinstance(answer, str) for answer in answers):
        raise DatasetError(f"{location}: golden answers must be strings, got {answers!r}")
    return tuple(answers)


def _processed_target(row: dict[str, Any]) -> Any:
    reward_model = row.get("reward_model")
    ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    return ground_truth.get("target") if isinstance(ground_truth, dict) else None
