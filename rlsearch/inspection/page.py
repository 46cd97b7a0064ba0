"""A static, self-contained HTML page of trajectories, turn by turn and token by token.

Every response token is a span coloured by its loss mask (sampled by the policy and trained, or an observation
the tools appended), its title giving the token id, the engine's logprob and, where the record has the actor's,
the actor's and their gap, which also marks the token (the larger the gap, the stronger the marker), and where the
record has the critic's values (algo.advantage=gae) the value at each sampled token. Tokens are decoded with the run's
tokenizer; without one the page shows each turn's text instead, and says so.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from .index import EVAL, answer_of
from .rubrics import RubricHistory, history_html, load_rubric_history, scores_html

MAX_PAGE_TRAJECTORIES = 200  # a page with every step of a long run would not open; --step picks others
# marker classes of a sampled token by its engine-vs-actor |logprob gap|, largest first
GAP_CLASSES = ((1e-1, "g3"), (1e-2, "g2"), (1e-3, "g1"))

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin: 0 0 .4em; }
.note { background: #fff8c5; padding: .4em .7em; border-radius: 4px; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left; vertical-align: top; }
table.index td, table.index th { border-bottom: 1px solid #d0d7de; }
section.trajectory, section.rubrics { border: 1px solid #d0d7de; border-radius: 6px; padding: .8em 1em;
    margin: 1.2em 0; }
table.facts th { color: #57606a; font-weight: normal; white-space: nowrap; }
.turn { border-left: 3px solid #8c959f; padding: .2em .8em; margin: .6em 0; }
.turn-head { color: #57606a; font-size: .9em; }
.tokens, .text, pre { white-space: pre-wrap; word-break: break-word; font: 13px/1.6 ui-monospace, monospace; }
.tok { border-radius: 2px; }
.m1 { background: #dbeafe; }
.m0 { background: #eeeeee; color: #57606a; }
.g1 { box-shadow: inset 0 -2px 0 rgba(207, 34, 46, .35); }
.g2 { box-shadow: inset 0 -3px 0 rgba(207, 34, 46, .7); }
.g3 { box-shadow: inset 0 -3px 0 rgb(207, 34, 46); background: #ffd8d3; }
.seg-start { border-left: 3px double #8250df; }
.error { color: #cf222e; }
.calls { margin: .3em 0; padding-left: 1.2em; }
.legend span { margin-right: 1em; padding: 0 .3em; }
"""


@dataclass(frozen=True)
class WrittenPage:
    path: Path
    steps: list[int]
    trajectories: int
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        steps = ", ".join(map(str, self.steps))
        return "\n".join([f"wrote {self.path}: {self.trajectories} trajectories of step(s) {steps}", *self.notes])


@dataclass(frozen=True)
class Token:
    token_id: int
    sampled: bool  # loss mask 1: the policy sampled it (and trains on it)
    engine_logprob: float
    actor_logprob: float | None
    starts_segment: bool  # the first response token of a segment after the first (a user agent's rewritten history)
    value: float | None = None  # the critic's value of the state before the token (gae runs' "critic_values")

    @property
    def gap(self) -> float | None:
        if not self.sampled or self.actor_logprob is None:
            return None
        return abs(self.actor_logprob - self.engine_logprob)


class Detokenizer:
    """Text of token ids with the run's tokenizer; a single token's text is cached (pages repeat tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def token(self, token_id: int) -> str:
        if token_id not in self.token_texts:
            self.token_texts[token_id] = self.tokenizer.decode([token_id])
        return self.token_texts[token_id]


def write_page(db: sqlite3.Connection, run_dir: Path, source: str, step: int | None,
               out: str | Path | None = None) -> WrittenPage:
    """The page of `step` (default: the latest steps up to MAX_PAGE_TRAJECTORIES trajectories) at `out` (default
    RUN/inspect/step_N.html, or steps_A-B.html)."""
    chosen = _page_steps(db, source, step)
    placeholders = ", ".join("?" * len(chosen))
    rows = db.execute(
        f"SELECT file, byte_offset, step FROM trajectories WHERE source = ? AND step IN ({placeholders}) "
        "ORDER BY step, group_id, sample_index", [source, *chosen]).fetchall()
    notes = []
    if len(rows) > MAX_PAGE_TRAJECTORIES:
        notes.append(f"step {chosen[0]} has {len(rows)} trajectories: the page shows the first "
                     f"{MAX_PAGE_TRAJECTORIES}")
        rows = rows[:MAX_PAGE_TRAJECTORIES]
    if step is None:
        all_steps = [value for (value,) in db.execute(
            "SELECT DISTINCT step FROM trajectories WHERE source = ? ORDER BY step", (source,))]
        if len(chosen) < len(all_steps):
            notes.append(f"the page shows the latest {len(chosen)} of {len(all_steps)} steps (at most "
                         f"{MAX_PAGE_TRAJECTORIES} trajectories); --step N writes another step's page")
    # the index's step: an eval record has none of its own, it is the training step the eval scored
    records = [{**_read_record(run_dir / file, offset), "step": step} for file, offset, step in rows]
    detokenizer, tokenizer_note = load_detokenizer(run_dir)
    notes.append(tokenizer_note)
    history, history_note = load_rubric_history(run_dir)
    notes += [history_note] if history_note else []
    prefix = "eval_" if source == EVAL else ""
    name = f"step_{chosen[0]:06d}" if len(chosen) == 1 else f"steps_{chosen[0]:06d}-{chosen[-1]:06d}"
    path = Path(out) if out else run_dir / "inspect" / f"{prefix}{name}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    title = f"{run_dir.name}: {source} trajectories, step(s) {', '.join(map(str, chosen))}"
    path.write_text(render_page(records, title, detokenizer, notes, history), encoding="utf-8")
    return WrittenPage(path, chosen, len(records), notes)


def _page_steps(db: sqlite3.Connection, source: str, step: int | None) -> list[int]:
    """`step`, or the latest steps whose trajectories fit the page (at least the last one)."""
    if step is not None:
        return [step]
    chosen, count = [], 0
    for latest, trajectories in db.execute(
            "SELECT step, COUNT(*) FROM trajectories WHERE source = ? GROUP BY step ORDER BY step DESC", (source,)):
        if chosen and count + trajectories > MAX_PAGE_TRAJECTORIES:
            break
        chosen.insert(0, latest)
        count += trajectories
    return chosen


def _read_record(path: Path, offset: int) -> dict:
    with path.open("rb") as handle:
        handle.seek(offset)
        return json.loads(handle.readline())


def load_detokenizer(run_dir: Path) -> tuple[Detokenizer | None, str]:
    """A detokenizer from the run's tokenizer (its config's model.path, else a checkpoint's hf/ copy), offline;
    None when none loads. Also the note the page shows about it."""
    from ..checkpoint.layout import HF_DIR

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    candidates = []
    for config_name in ("config.json", "eval_config.json"):
        config_path = run_dir / config_name
        if config_path.is_file():
            model_path = json.loads(config_path.read_text()).get("model", {}).get("path")
            if model_path:
                candidates.append(Path(model_path))
    candidates += sorted(run_dir.glob(f"checkpoints/step_*/{HF_DIR}"), reverse=True)
    failures = []
    for candidate in candidates:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(candidate))
        except Exception as error:  # any failure to load means: show the text instead
            failures.append(f"{candidate}: {type(error).__name__}")
            continue
        return Detokenizer(tokenizer), f"tokens decoded with the tokenizer of {candidate}"
    tried = "; ".join(failures) or "no model.path in the run's config.json and no checkpoint"
    return None, (f"no tokenizer could be loaded ({tried}): the page shows each turn's text and observation "
                  "instead of its tokens")


def render_page(records: list[dict], title: str, detokenizer: Detokenizer | None, notes: list[str],
                rubric_history: RubricHistory | None) -> str:
    """The whole page: notes, a legend, an index linking each trajectory, the rubric history of the page's
    questions (evolving rubrics), then the trajectories."""
    index_rows = "".join(
        f'<tr><td><a href="#traj-{number}">{number}</a></td>{_cells(record["step"])}'
        f'{_cells(record["example_id"], record["group_id"], record["sample_index"], _number(record["reward"]))}'
        f'{_cells(len(record["turns"]), sum(len(turn["tool_calls"]) for turn in record["turns"]))}'
        f'{_cells(record.get("failed") or "")}</tr>'
        for number, record in enumerate(records, start=1))
    sections = "".join(_trajectory(record, number, detokenizer) for number, record in enumerate(records, start=1))
    notes_html = "".join(f'<p class="note">{escape(note)}</p>' for note in notes)
    rubrics = history_html(rubric_history, (record["example_id"] for record in records)) if rubric_history else ""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body><h1>{escape(title)}</h1>{notes_html}"
        '<p class="legend"><span class="tok m1">sampled by the policy (trained)</span>'
        '<span class="tok m0">observation (not trained)</span>'
        '<span class="tok m1 g1">actor-engine gap &ge; 1e-3</span><span class="tok m1 g2">&ge; 1e-2</span>'
        '<span class="tok m1 g3">&ge; 1e-1</span> hover a token for its id, logprobs and (gae runs) the critic\'s '
        "value</p>"
        '<table class="index"><tr><th>#</th><th>step</th><th>example</th><th>group</th><th>sample</th>'
        f"<th>reward</th><th>turns</th><th>tool calls</th><th>failed</th></tr>{index_rows}</table>\n"
        f"{rubrics}{sections}</body></html>\n"
    )


def _cells(*values: object) -> str:
    return "".join(f"<td>{escape(str(value))}</td>" for value in values)


def _number(value: float) -> str:
    return f"{value:.3f}"


def _trajectory(record: dict, number: int, detokenizer: Detokenizer | None) -> str:
    tokens = response_tokens(record)
    heading = (f'step {record["step"]} · {record["example_id"]} · group {record["group_id"]} · '
               f'sample {record["sample_index"]} · reward {_number(record["reward"])}')
    body = _turns_with_tokens(record, tokens, detokenizer) if detokenizer else _turns_as_text(record)
    return (f'<section class="trajectory" id="traj-{number}"><h2>{escape(heading)}</h2>'
            f"{_facts(record, tokens)}{scores_html(record)}{_prompt(record, detokenizer)}{body}</section>\n")


def _facts(record: dict, tokens: list[Token]) -> str:
    gaps = [token.gap for token in tokens if token.gap is not None]
    scores = ", ".join(f"{name} {value:g}" for name, value in (record.get("scores") or {}).items())
    versions = ", ".join(map(str, record.get("weight_versions", [])))
    rollout = (f'finish {record.get("finish_reason", "-")} · staleness {record.get("staleness", "-")} · '
               f'weight versions {versions} · engine {record.get("engine", "-")}')
    folds = sum(turn["kind"] == "summary" for turn in record.get("turns", []))
    context = (f'{1 + len(record.get("earlier_segments") or [])} segment(s), {folds} fold(s) · cuts: '
               f'{", ".join(record.get("truncations") or []) or "none"}')
    facts = [
        ("question", record.get("question", "")),
        ("golden answers", "; ".join(map(str, record.get("golden_answers", [])))),
        ("answer", answer_of(record) or "-"),
        ("reward", f'{_number(record["reward"])} ({scores})'),
        ("rollout", rollout),
        ("context", context),
        ("engine-actor gap", f"max {max(gaps):.2e} over {len(gaps)} sampled tokens" if gaps else
         "- (no actor logprobs: one update a step trains on-policy)"),
    ]
    values = [token.value for token in tokens if token.sampled and token.value is not None]
    if values:
        facts.append(("critic values", f"{values[0]:.4f} at the first sampled token, min {min(values):.4f}, max "
                                       f"{max(values):.4f} over {len(values)} (hover a token for its own)"))
    rows = "".join(f"<tr><th>{escape(name)}</th><td>{escape(str(value))}</td></tr>" for name, value in facts)
    if record.get("failed"):
        rows += f'<tr><th>failed</th><td class="error">{escape(record["failed"])}</td></tr>'
    return f'<table class="facts">{rows}</table>'


def _prompt(record: dict, detokenizer: Detokenizer | None) -> str:
    prompt_ids = record.get("prompt_ids", [])
    text = detokenizer.text(prompt_ids) if detokenizer else record.get("prompt", "(no tokenizer to decode it)")
    return (f"<details><summary>prompt ({len(prompt_ids)} tokens, the assistant's prefill included)</summary>"
            f"<pre>{escape(text)}</pre></details>")


def response_tokens(record: dict) -> list[Token]:
    """Every response token of every segment (earlier segments first), with its mask, logprobs and critic value."""
    segments = [*record.get("earlier_segments", []), record]
    tokens = []
    for index, segment in enumerate(segments):
        missing = [None] * len(segment["response_ids"])
        actor = segment.get("actor_logprobs") or missing
        values = segment.get("critic_values") or missing
        tokens += [Token(token_id, mask == 1, engine, actor_logprob, index > 0 and position == 0, value)
                   for position, (token_id, mask, engine, actor_logprob, value) in enumerate(zip(
                       segment["response_ids"], segment["loss_mask"], segment["rollout_logprobs"], actor, values))]
    return tokens


def split_by_turn(turns: list[dict], tokens: list[Token]) -> tuple[list[tuple[list[Token], list[Token]]], list[Token]]:
    """Each turn's (sampled tokens, observation tokens that follow), and the tokens no turn accounts for. A turn
    holds its num_tokens tokens; the observation is the run of unsampled tokens after them."""
    by_turn, position = [], 0
    for turn in turns:
        end = position + turn["num_tokens"]
        observation_end = end
        while observation_end < len(tokens) and not tokens[observation_end].sampled:
            observation_end += 1
        by_turn.append((tokens[position:end], tokens[end:observation_end]))
        position = observation_end
    return by_turn, tokens[position:]


def _turns_with_tokens(record: dict, tokens: list[Token], detokenizer: Detokenizer) -> str:
    by_turn, rest = split_by_turn(record["turns"], tokens)
    parts = [_turn(index, turn, _token_spans(sampled, detokenizer), _token_spans(observation, detokenizer))
             for index, (turn, (sampled, observation)) in enumerate(zip(record["turns"], by_turn), start=1)]
    if rest:
        parts.append(f'<div class="unattributed"><div class="turn-head">{len(rest)} tokens after the last turn'
                     f'</div><div class="tokens">{_token_spans(rest, detokenizer)}</div></div>')
    return "".join(parts)


def _turns_as_text(record: dict) -> str:
    return "".join(
        _turn(index, turn, f'<span class="m1">{escape(turn["text"])}</span>',
              f'<span class="m0">{escape(turn["observation"])}</span>' if turn.get("observation") else "")
        for index, turn in enumerate(record["turns"], start=1))


def _turn(number: int, turn: dict, sampled_html: str, observation_html: str) -> str:
    head = f'turn {number} · {turn["kind"]} · {turn["num_tokens"]} sampled tokens'
    error = f"<div>{_error(turn)}</div>" if turn.get("error_kind") or turn.get("error") else ""
    observation = f'<div class="tokens observation">{observation_html}</div>' if observation_html else ""
    return (f'<div class="turn"><div class="turn-head">{escape(head)}</div>{error}'
            f'<div class="tokens">{sampled_html}</div>{_calls(turn)}{observation}</div>')


def _calls(turn: dict) -> str:
    if not turn["tool_calls"]:
        return ""
    outputs = turn.get("tool_outputs") or []
    items = []
    for index, call in enumerate(turn["tool_calls"]):
        arguments = call.get("arguments") or {"query": call.get("query", "")}
        status = _error(call) if call.get("error_kind") else "ok"
        output = (f"<details><summary>output</summary><pre>{escape(outputs[index])}</pre></details>"
                  if index < len(outputs) else "")
        items.append(f'<li><b>{escape(call["name"])}</b> <code>{escape(json.dumps(arguments, ensure_ascii=False))}'
                     f"</code> {status}{output}</li>")
    return f'<ul class="calls">{"".join(items)}</ul>'


def _error(turn_or_call: dict) -> str:
    kind, message = turn_or_call.get("error_kind") or "error", turn_or_call.get("error") or ""
    return f'<span class="error">{escape(kind)}: {escape(message)}</span>'


def _token_spans(tokens: list[Token], detokenizer: Detokenizer) -> str:
    return "".join(_token_span(token, detokenizer.token(token.token_id)) for token in tokens)


def _token_span(token: Token, text: str) -> str:
    classes = ["tok", "m1" if token.sampled else "m0"]
    if token.sampled:
        title = f"#{token.token_id} sampled · engine logprob {token.engine_logprob:.4f}"
    else:
        title = f"#{token.token_id} observation (not trained)"
    gap = token.gap
    if gap is not None:
        title += f" · actor {token.actor_logprob:.4f} · gap {gap:.2e}"
        classes += [name for threshold, name in GAP_CLASSES if gap >= threshold][:1]
    if token.sampled and token.value is not None:
        title += f" · value {token.value:.4f}"
    if token.starts_segment:
        classes.append("seg-start")
        title += " · a new segment starts here (the agent rewrote its history)"
    return f'<span class="{" ".join(classes)}" title="{escape(title)}">{escape(text)}</span>'
