"""Eval metrics per data_source and overall, computed from trajectory records (dicts as in trajectories.jsonl)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence

OVERALL = "overall"

# the error kinds of a call that reached its tool and failed there; refused or never run, a call reached none
_FAILED_THERE = ("timeout", "tool_error")
_REACHED_NONE = ("unknown_tool", "over_limit", "not_run")

# (column header, metric key, format) of the terminal table; pass@k / mean@k columns are added for k > 1
_TABLE_COLUMNS = (
    ("questions", "questions", "{:.0f}"),
    ("samples", "samples", "{:.0f}"),
    ("EM", "em", "{:.3f}"),
    ("F1", "f1", "{:.3f}"),
    ("subEM", "substring_em", "{:.3f}"),
    ("answer", "answer_rate", "{:.3f}"),
    ("turns", "turns", "{:.2f}"),
    ("calls", "tool_calls", "{:.2f}"),
    ("tool_fail", "tool_failures", "{:.0f}"),
    ("invalid", "invalid_call_rate", "{:.3f}"),
    ("tokens", "response_tokens", "{:.1f}"),
    ("time_s", "time_s", "{:.1f}"),
)
_HOPS_COLUMNS = (*_TABLE_COLUMNS[:4], ("searches", "searches", "{:.2f}"))  # questions, samples, EM, F1


def summarize(records: Sequence[Mapping], n_samples: int) -> dict[str, dict[str, float]]:
    """Metrics of each data_source (sorted) and of all records together (`overall`, last).

    em / f1 / substring_em / answer_rate, turns, tool_calls and response_tokens are means over trajectories
    (with k samples per question, em is mean@k); invalid_call_rate is invalid calls over all call attempts
    (valid tool calls + invalid calls); tool_failures counts the calls that reached their tool and failed there
    (timed out, a tool error); time_s adds up each trajectory's share of its batch's wall time.
    """
    by_source: dict[str, list[Mapping]] = defaultdict(list)
    for record in records:
        by_source[record["data_source"]].append(record)
    metrics = {source: _group_metrics(by_source[source], n_samples) for source in sorted(by_source)}
    metrics[OVERALL] = _group_metrics(records, n_samples)
    return metrics


def _group_metrics(records: Sequence[Mapping], n_samples: int) -> dict[str, float]:
    em_by_question: dict[tuple[str, str], list[float]] = defaultdict(list)
    for record in records:
        em_by_question[(record["eval_file"], record["example_id"])].append(record["scores"]["em"])
    tool_calls = sum(_num_tool_calls(record) for record in records)
    invalid_calls = sum(turn["kind"] == "invalid_call" for record in records for turn in record["turns"])
    metrics = {
        "questions": float(len(em_by_question)),
        "samples": float(len(records)),
        "em": _mean(record["scores"]["em"] for record in records),
        "f1": _mean(record["scores"]["f1"] for record in records),
        "substring_em": _mean(record["scores"]["substring_em"] for record in records),
        "answer_rate": _mean(record["scores"]["has_answer"] for record in records),
        "turns": _mean(len(record["turns"]) for record in records),
        "tool_calls": tool_calls / len(records) if records else 0.0,
        "tool_failures": float(sum(call.get("error_kind") in _FAILED_THERE for call in _calls(records))),
        "invalid_call_rate": invalid_calls / (tool_calls + invalid_calls) if invalid_calls else 0.0,
        "response_tokens": _mean(len(record["response_ids"]) for record in records),
        "time_s": sum(record["time_s"] for record in records),
        # trajectories a user agent or the reward judge failed: they count as unanswered
        "failed": float(sum(bool(record.get("failed")) for record in records)),
    }
    if n_samples > 1:
        metrics[f"pass@{n_samples}"] = _mean(float(max(ems)) for ems in em_by_question.values())
        metrics[f"mean@{n_samples}"] = _mean(statistics.fmean(ems) for ems in em_by_question.values())
    return metrics


def summarize_by_hops(records: Sequence[Mapping]) -> dict[str, dict[str, dict[str, float]]]:
    """Per data_source (sorted) and hop count (ascending, as text) of the records that carry ``hops`` (multihop rows):
    questions, samples, em, f1 (means over trajectories) and searches (calls of the search tool per trajectory).
    Empty when no record carries hops."""
    groups: dict[tuple[str, int], list[Mapping]] = defaultdict(list)
    for record in records:
        if record.get("hops"):
            groups[(record["data_source"], int(record["hops"]))].append(record)
    by_hops: dict[str, dict[str, dict[str, float]]] = {}
    for source, hops in sorted(groups):
        group = groups[(source, hops)]
        by_hops.setdefault(source, {})[str(hops)] = {
            "questions": float(len({(record["eval_file"], record["example_id"]) for record in group})),
            "samples": float(len(group)),
            "em": _mean(record["scores"]["em"] for record in group),
            "f1": _mean(record["scores"]["f1"] for record in group),
            "searches": _mean(_num_searches(record) for record in group),
        }
    return by_hops


def tool_failure_warning(records: Sequence[Mapping]) -> str:
    """A warning when most calls that reached a tool failed there ("" otherwise): the scores then measure the tools,
    not the model."""
    reached = [call for call in _calls(records) if call.get("error_kind") not in _REACHED_NONE]
    failed = [call for call in reached if call.get("error_kind") in _FAILED_THERE]
    if 2 * len(failed) <= len(reached):
        return ""
    again = sum(tool_was_unavailable(record) for record in records)
    return (f"WARNING: {len(failed)} of {len(reached)} tool calls failed (first: {failed[0]['name']}: "
            f"{failed[0]['error']}); the scores measure the tools, not the model. Fix the tool ('tools.retriever.url' "
            "for search) and run again into the same output_dir"
            + (f": it generates again the {again} trajectories whose tool was unavailable" if again else ""))


def tool_was_unavailable(record: Mapping) -> bool:
    """Whether a call of the trajectory failed for its tool's service (unreachable, a malformed reply, ...)."""
    return any(call.get("unavailable") for call in _calls([record]))


def _calls(records: Sequence[Mapping]):
    return (call for record in records for turn in record["turns"] for call in turn["tool_calls"])


def _num_searches(record: Mapping) -> int:
    return sum(call["name"] == "search" for turn in record["turns"] for call in turn["tool_calls"])


def _num_tool_calls(record: Mapping) -> int:
    return sum(len(turn["tool_calls"]) for turn in record["turns"])


def _mean(values) -> float:
    values = list(values)
    return float(statistics.fmean(values)) if values else 0.0


def render_table(metrics: Mapping[str, Mapping[str, float]], n_samples: int) -> str:
    columns = list(_TABLE_COLUMNS)
    if n_samples > 1:
        columns[4:4] = [(f"pass@{n_samples}", f"pass@{n_samples}", "{:.3f}"),
                        (f"mean@{n_samples}", f"mean@{n_samples}", "{:.3f}")]
    rows = [["data_source", *(header for header, _, _ in columns)]]
    rows += [[group, *(fmt.format(values[key]) for _, key, fmt in columns)] for group, values in metrics.items()]
    return _aligned(rows)


def render_hops_table(by_hops: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """`summarize_by_hops`' breakdown as a table: a row per data_source and hop count."""
    rows = [["data_source", "hops", *(header for header, _, _ in _HOPS_COLUMNS)]]
    rows += [[source, hops, *(fmt.format(values[key]) for _, key, fmt in _HOPS_COLUMNS)]
             for source, per_hops in by_hops.items() for hops, values in per_hops.items()]
    return _aligned(rows)


def _aligned(rows: list[list[str]]) -> str:
    """The rows as text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) if index == 0 else cell.rjust(width) for index, (cell, width) in
                  enumerate(zip(row, widths)))
        for row in rows
    )
