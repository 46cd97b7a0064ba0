"""`rlsearch inspect` on a real run's trajectories: every query's figures against the same figures computed here from
the raw JSONL (plain Python, nothing shared with rlsearch.inspection), the incremental index, the malformed-line error,
the HTML page token by token, and the command line."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from html.parser import HTMLParser
from pathlib import Path
from statistics import fmean

import pytest

from rlsearch.cli import main
from rlsearch.inspection import (
    QUERY_NAMES,
    InspectError,
    answers_without_search,
    find_questions,
    format_only_rewards,
    open_index,
    overview,
    question_history,
    staleness,
    tool_errors,
    truncations,
    uniform_groups,
    uniform_groups_per_step,
    update_index,
    write_page,
)
from tests.constants import REPO_ROOT


@pytest.fixture(scope="module")
def real_run(async_tp2pp2_run) -> Path:
    """A real run of the random-init model (no SFT warm start; the rare outcomes are tested on edited records below):
    async rollout, so step 2 samples with weights one update old (staleness 1), two updates a step (actor logprobs),
    2 questions x 4 samples a step (conftest's run, which test_train_e2e checks too)."""
    return async_tp2pp2_run[0]


def _copy_run(run: Path, destination: Path) -> Path:
    """The run's trajectories and config, without its index."""
    shutil.copytree(run / "trajectories", destination / "trajectories")
    shutil.copy(run / "config.json", destination / "config.json")
    return destination


# ---- the figures, computed from the JSONL -------------------------------------------------------------------------

def read_records(run: Path, pattern: str = "trajectories/step_*.jsonl") -> list[dict]:
    records = []
    for path in sorted(run.glob(pattern)):
        step = int(re.search(r"step_(\d+)", str(path.relative_to(run))).group(1))
        records += [{**json.loads(line), "file_step": step} for line in path.read_text().splitlines()]
    return records


def correct(record: dict) -> bool:
    scores = record["scores"]
    return (scores["correct"] if "correct" in scores else scores.get("em", 0.0)) > 0


def calls(record: dict) -> int:
    return sum(len(turn["tool_calls"]) for turn in record["turns"])


def answer(record: dict) -> str | None:
    model_text = record["assistant_prefix"] + "".join(turn["text"] for turn in record["turns"])
    found = re.findall(r"<answer>(.*?)</answer>", model_text, re.DOTALL)
    return found[-1].strip() if found else None


def by_step(records: list[dict]) -> dict[int, list[dict]]:
    steps = defaultdict(list)
    for record in records:
        steps[record["file_step"]].append(record)
    return dict(sorted(steps.items()))


def expected_overview(records):
    rows = []
    for step, rs in by_step(records).items():
        rewards = [r["reward"] for r in rs if not r["failed"]]
        ems = [r["scores"]["em"] for r in rs if "em" in r["scores"]]
        rows.append((step, len(rs), len({(r["group_id"], r["example_id"]) for r in rs}),
                     fmean(rewards) if rewards else None, fmean(ems) if ems else None, fmean(map(correct, rs)),
                     fmean(map(calls, rs)), fmean(sum(t["kind"] == "invalid_call" for t in r["turns"]) for r in rs),
                     sum(bool(r["failed"]) for r in rs)))
    return rows


def expected_groups(records):
    groups = defaultdict(list)
    for r in records:
        if not r["failed"]:
            groups[(r["file_step"], r["group_id"], r["example_id"])].append(r["reward"])
    return groups


def expected_uniform_per_step(records):
    rows = []
    for step in sorted({key[0] for key in expected_groups(records)}):
        rewards = [values for key, values in expected_groups(records).items() if key[0] == step]
        uniform = sum(len(set(values)) == 1 for values in rewards)
        rows.append((step, len(rewards), uniform, uniform / len(rewards)))
    return rows


def expected_uniform_groups(records):
    return sorted((step, group, example, len(values), values[0])
                  for (step, group, example), values in expected_groups(records).items() if len(set(values)) == 1)


def expected_tool_errors(records, per_step: bool):
    errors, totals = Counter(), Counter()
    for r in records:
        at = r["file_step"] if per_step else "all"
        for turn in r["turns"]:
            for call in turn["tool_calls"]:
                totals[(at, call["name"])] += 1
                if call.get("error_kind"):
                    errors[(at, call["name"], call["error_kind"])] += 1
            if not turn["tool_calls"] and turn.get("error_kind"):
                totals[(at, "(invalid call)")] += 1
                errors[(at, "(invalid call)", turn["error_kind"])] += 1
    return sorted(((at, tool, kind, count, totals[(at, tool)]) for (at, tool, kind), count in errors.items()),
                  key=lambda row: (row[0], -row[3], row[1], row[2]))


def trajectory_rows(records, keep):
    rows = [(r["file_step"], r["example_id"], r["group_id"], r["sample_index"], r["reward"], r["scores"].get("em"),
             calls(r), answer(r), "; ".join(r["golden_answers"])) for r in records if keep(r)]
    return sorted(rows, key=lambda row: (row[0], row[2], row[3]))


def expected_staleness(records):
    rows = []
    for step, rs in by_step(records).items():
        counts = Counter(r["staleness"] for r in rs)
        rows += [(step, value, count, count / len(rs)) for value, count in sorted(counts.items())]
    return rows


def expected_truncations(records):
    rows = []
    for step, rs in by_step(records).items():
        cuts = Counter(reason for r in rs for reason in r["truncations"])
        cut = Counter(reason for r in rs for reason in set(r["truncations"]))
        rows += [(step, reason, count, cut[reason], cut[reason] / len(rs)) for reason, count in sorted(cuts.items())]
    return rows


def assert_rows(actual, expected):
    assert len(actual) == len(expected), (actual, expected)
    for got, want in zip(actual, expected):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a == (pytest.approx(b) if isinstance(b, float) else b), (got, want)


def assert_queries_match(run: Path, records: list[dict]) -> None:
    update_index(run)
    db = open_index(run)
    try:
        assert_rows(overview(db, "train"), expected_overview(records))
        assert_rows(uniform_groups_per_step(db, "train"), expected_uniform_per_step(records))
        assert_rows(uniform_groups(db, "train"), expected_uniform_groups(records))
        assert_rows(tool_errors(db, "train"), expected_tool_errors(records, per_step=True))
        assert_rows(tool_errors(db, "train", by_step=False), expected_tool_errors(records, per_step=False))
        assert_rows(answers_without_search(db, "train"),
                    trajectory_rows(records, lambda r: correct(r) and calls(r) == 0))
        assert_rows(format_only_rewards(db, "train"),
                    trajectory_rows(records, lambda r: r["reward"] > 0 and not correct(r) and not r["failed"]))
        assert_rows(staleness(db, "train"), expected_staleness(records))
        assert_rows(truncations(db, "train"), expected_truncations(records))
        for step in {r["file_step"] for r in records}:  # --step narrows each query to one step's rows
            assert_rows(overview(db, "train", step), [row for row in expected_overview(records) if row[0] == step])
            assert_rows(staleness(db, "train", step), [row for row in expected_staleness(records) if row[0] == step])
        example = records[0]
        samples = sorted((r["file_step"], r["group_id"], r["sample_index"], r["reward"], r["scores"].get("em"),
                          calls(r), r["finish_reason"], answer(r)) for r in records
                         if r["example_id"] == example["example_id"])
        assert_rows(question_history(db, example["example_id"], "train"), samples)
        text = example["question"][4:20].upper()  # any part of the question, in any case
        expected_ids = sorted({r["example_id"] for r in records if text.lower() in r["question"].lower()})
        assert [match.example_id for match in find_questions(db, text, "train")] == expected_ids
        assert [match.trajectories for match in find_questions(db, example["example_id"], "train")] == [len(samples)]
    finally:
        db.close()


# ---- queries ------------------------------------------------------------------------------------------------------

def test_real_run_has_what_inspect_shows(real_run):
    records = read_records(real_run)
    assert {r["file_step"] for r in records} == {1, 2} and len(records) == 16
    assert {r["staleness"] for r in records if r["file_step"] == 2} == {1}  # async: one version behind
    assert all(len(r["actor_logprobs"]) == len(r["response_ids"]) for r in records)  # two updates a step
    assert any(turn["tool_calls"] for r in records for turn in r["turns"])
    # the random model is cut, by the turn or the response budget: the truncations query has rows to check
    assert any(r["truncations"] for r in records)
    # a run cut by max_turns says so last (over every record: a filter on max_turns could match none)
    assert all((r["finish_reason"] == "max_turns") == (r["truncations"][-1:] == ["max_turns"]) for r in records)


def test_every_query_equals_the_figures_of_the_jsonl(real_run):
    assert_queries_match(real_run, read_records(real_run))


def _edited(record: dict, **changes) -> dict:
    return {**json.loads(json.dumps(record)), **changes}


def test_rare_outcomes_on_edited_records(real_run, tmp_path):
    """The random model hardly ever answers: answers found without searching, reward from the format alone, tool
    errors and failures come from real records with fields edited."""
    records = read_records(real_run)
    plain = next(r for r in records if not any(turn["tool_calls"] for turn in r["turns"]))
    searching = next(r for r in records if any(turn["tool_calls"] for turn in r["turns"]))
    answer_turn = {**plain["turns"][0], "text": "done <answer>Mount Ethai</answer>", "kind": "answer"}
    failed_call = {**searching["turns"][0]["tool_calls"][0], "ok": False, "error_kind": "timeout", "error": "slow"}
    edited = [
        _edited(plain, sample_index=0, reward=1.0, scores={"em": 1.0}, turns=[answer_turn]),  # no search, right
        _edited(searching, sample_index=1, reward=1.0, scores={"em": 1.0}),  # right after searching
        _edited(plain, sample_index=2, reward=0.1, scores={"em": 0.0}, turns=[answer_turn]),  # format only
        _edited(searching, sample_index=3, reward=0.2, scores={"em": 0.0}, failed="agent: raised"),  # failed
        _edited(plain, sample_index=4, reward=0.0, scores={"correct": 1.0}, turns=[answer_turn]),  # judge: right
        _edited(searching, sample_index=5, reward=0.0, scores={"em": 0.0},
                turns=[{**searching["turns"][0], "tool_calls": [failed_call]}]),
    ]
    run = tmp_path / "edited"
    (run / "trajectories").mkdir(parents=True)
    (run / "trajectories" / "step_000004.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edited))
    edited = read_records(run)
    assert_queries_match(run, edited)
    db = open_index(run)
    try:
        golden = "; ".join(plain["golden_answers"])
        no_search = [(4, plain["example_id"], plain["group_id"], 0, 1.0, 1.0, 0, "Mount Ethai", golden),
                     (4, plain["example_id"], plain["group_id"], 4, 0.0, None, 0, "Mount Ethai", golden)]
        assert [tuple(row) for row in answers_without_search(db, "train")] == no_search
        format_only = [(4, plain["example_id"], plain["group_id"], 2, 0.1, 0.0, 0, "Mount Ethai", golden)]
        assert [tuple(row) for row in format_only_rewards(db, "train")] == format_only
        searches = sum(1 for r in edited for turn in r["turns"] for call in turn["tool_calls"])
        assert ("search", "timeout", 1, searches) in [row[1:] for row in tool_errors(db, "train")]
    finally:
        db.close()


def test_eval_trajectories_are_indexed_by_the_step_they_scored(real_run, tmp_path, capsys):
    """A periodic eval's lines (RUN/eval/step_N/trajectories.jsonl) carry no step: theirs is the directory's."""
    run = _copy_run(real_run, tmp_path / "with_eval")
    (run / "config.json").write_text("{}")  # no tokenizer: the page shows the turns' text
    (run / "eval" / "step_000002").mkdir(parents=True)
    as_eval = [{key: value for key, value in r.items() if key not in ("step", "file_step")}
               for r in read_records(real_run, "trajectories/step_000001.jsonl")]
    (run / "eval" / "step_000002" / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in as_eval))
    update_index(run)
    db = open_index(run)
    try:
        evals = read_records(run, "eval/step_*/trajectories.jsonl")
        assert_rows(overview(db, "eval"), expected_overview(evals))
        assert_rows(overview(db, "train"), expected_overview(read_records(run)))
    finally:
        db.close()
    assert main(["inspect", str(run), "--eval", "--html"]) == 0
    assert f"wrote {run / 'inspect' / 'eval_step_000002.html'}: 8 trajectories" in capsys.readouterr().out
    page = (run / "inspect" / "eval_step_000002.html").read_text()
    assert len(re.findall(r'<td><a href="#traj-\d+">\d+</a></td><td>2</td>', page)) == 8


# ---- the index ----------------------------------------------------------------------------------------------------

def _count(run: Path, sql: str) -> int:
    db = open_index(run)
    try:
        return db.execute(sql).fetchone()[0]
    finally:
        db.close()


def test_index_reads_only_new_lines_and_new_files(real_run, tmp_path):
    run = _copy_run(real_run, tmp_path / "growing")
    first = update_index(run)
    assert (first.new_lines, first.total) == (16, 16)
    assert update_index(run).new_lines == 0  # nothing new: nothing read

    step_2 = (run / "trajectories" / "step_000002.jsonl").read_bytes()
    (run / "trajectories" / "step_000003.jsonl").write_bytes(step_2)  # a new step: the same lines again
    grown = update_index(run)
    assert (grown.new_lines, grown.files_read, grown.total) == (8, 1, 24)
    assert _count(run, "SELECT COUNT(*) FROM trajectories WHERE step = 3") == 8
    assert _count(run, "SELECT COUNT(*) FROM (SELECT DISTINCT file, line FROM trajectories)") == 24  # no duplicate
    assert update_index(run).new_lines == 0

    lines = step_2.splitlines(keepends=True)
    with (run / "trajectories" / "step_000003.jsonl").open("ab") as handle:
        handle.write(lines[0][:100])  # a run still writing: the line is not complete yet
    assert update_index(run).new_lines == 0
    with (run / "trajectories" / "step_000003.jsonl").open("ab") as handle:
        handle.write(lines[0][100:])
    assert (update_index(run).new_lines, _count(run, "SELECT COUNT(*) FROM trajectories WHERE step = 3")) == (1, 9)
    assert_queries_match(run, read_records(run))

    # a resumed run logs step 3 again (fewer lines here): its rows are replaced, not added to
    (run / "trajectories" / "step_000003.jsonl").write_bytes(b"".join(lines[:3]))
    rewritten = update_index(run)
    assert (rewritten.new_lines, rewritten.files_reindexed, rewritten.total) == (3, ["trajectories/step_000003.jsonl"],
                                                                                 19)
    (run / "trajectories" / "step_000003.jsonl").unlink()
    assert update_index(run).total == 16
    assert_queries_match(run, read_records(run))


def test_a_malformed_line_is_an_error_naming_file_and_line_and_loses_nothing(real_run, tmp_path, capsys):
    run = _copy_run(real_run, tmp_path / "malformed")
    path = run / "trajectories" / "step_000002.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[3:]))
    with pytest.raises(InspectError, match=re.escape(f"{path}:3: not a JSON trajectory record")):
        update_index(run)
    assert _count(run, "SELECT COUNT(*) FROM trajectories") == 8 + 2  # step 1, and step 2's lines before it

    assert main(["inspect", str(run)]) == 2
    assert f"rlsearch inspect: {path}:3: not a JSON trajectory record" in capsys.readouterr().err

    path.write_text("".join(lines[:2]) + '{"example_id": "x"}\n' + "".join(lines[3:]))
    with pytest.raises(InspectError, match=re.escape(f"{path}:3: not a trajectory record, it lacks group_id")):
        update_index(run)

    path.write_text("".join(lines))  # fixed: the update goes on from line 3
    assert update_index(run).new_lines == 6
    assert_queries_match(run, read_records(run))


# ---- the HTML page ------------------------------------------------------------------------------------------------

class PageStructure(HTMLParser):
    """Checks that every element is closed in order and ids are unique; collects each trajectory's turns and
    tokens (classes, title, text) and its observation text."""

    VOID = {"meta", "br", "hr", "img", "input", "link", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[tuple[str, list[str]]] = []
        self.ids: list[str] = []
        self.sections: list[dict] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if "id" in attrs:
            self.ids.append(attrs["id"])
        if tag == "section" and "trajectory" in classes:
            self.sections.append({"turns": 0, "tokens": [], "observation": "", "text": ""})
        elif self.sections and tag == "div" and "turn" in classes:
            self.sections[-1]["turns"] += 1
        elif self.sections and tag == "span" and "tok" in classes:
            self.sections[-1]["tokens"].append({"classes": classes, "title": attrs.get("title", ""), "text": ""})
        if tag not in self.VOID:
            self.open.append((tag, classes))

    def handle_endtag(self, tag):
        assert self.open, f"</{tag}> closes nothing at {self.getpos()}"
        assert self.open[-1][0] == tag, f"</{tag}> closes <{self.open[-1][0]}> at {self.getpos()}"
        self.open.pop()

    def handle_data(self, data):
        if not self.sections:
            return
        section = self.sections[-1]
        section["text"] += data
        if self.open and "tok" in self.open[-1][1]:
            section["tokens"][-1]["text"] += data
        if any("observation" in classes for _, classes in self.open):
            section["observation"] += data


def parse_page(text: str) -> PageStructure:
    page = PageStructure()
    page.feed(text)
    page.close()
    assert page.open == [], f"unclosed: {page.open}"
    assert len(page.ids) == len(set(page.ids)), "duplicate ids"
    return page


def test_html_page_shows_every_turn_and_token_of_the_step(real_run, capsys):
    assert main(["inspect", str(real_run), "--html", "--step", "2"]) == 0
    path = real_run / "inspect" / "step_000002.html"
    assert f"wrote {path}: 8 trajectories of step(s) 2" in capsys.readouterr().out
    text = path.read_text()
    assert "<script" not in text and "http://" not in text and "https://" not in text  # self-contained
    assert "tokens decoded with the tokenizer of" in text
    page = parse_page(text)
    records = sorted(read_records(real_run, "trajectories/step_000002.jsonl"),
                     key=lambda r: (r["group_id"], r["sample_index"]))
    assert len(page.sections) == len(records)
    for section, record in zip(page.sections, records):
        assert section["turns"] == len(record["turns"])
        tokens = section["tokens"]
        assert len(tokens) == len(record["response_ids"])
        assert ["m1" in token["classes"] for token in tokens] == [mask == 1 for mask in record["loss_mask"]]
        assert ["m0" in token["classes"] for token in tokens] == [mask == 0 for mask in record["loss_mask"]]
        for token, token_id, mask, engine, actor in zip(tokens, record["response_ids"], record["loss_mask"],
                                                        record["rollout_logprobs"], record["actor_logprobs"]):
            assert token["title"].startswith(f"#{token_id} ")
            if mask:  # the gap of every sampled token, in its tooltip
                assert f"gap {abs(actor - engine):.2e}" in token["title"]
            else:
                assert "gap" not in token["title"]
            assert " · value " not in token["title"]  # no critic in this run
        for turn in record["turns"]:
            for output in turn["tool_outputs"] if turn["tool_calls"] else []:
                assert html.escape(output) in text  # each call's output, escaped
        # the observation tokens read back as text: every observation (tool output or error), escaped in the page
        assert section["observation"] == "".join(turn["observation"] or "" for turn in record["turns"])
        assert record["question"] in section["text"]
    assert "<information>" not in text  # only ever escaped


def test_html_page_shows_the_critics_value_at_each_sampled_token(tiny_model_dir, tmp_path):
    """A gae run's record (written here: two segments, a tool call's observation between turns) carries the critic's
    value per response token of each segment; the page gives each sampled token's in its title, and the range in the
    trajectory's facts."""
    earlier = {"response_ids": [11, 12, 13, 14], "loss_mask": [1, 1, 0, 0], "rollout_logprobs": [-0.5, -0.25, 0, 0],
               "actor_logprobs": [-0.5, -0.25, 0, 0], "critic_values": [0.125, 0.25, 0.375, 0.5]}
    record = {
        "example_id": "toy-1", "group_id": 0, "sample_index": 0, "reward": 1.0, "scores": {"em": 1.0},
        "question": "Which river?", "golden_answers": ["Ethai"], "prompt_ids": [5, 6, 7], "failed": None,
        "turns": [{"kind": "tool_call", "num_tokens": 2, "text": "<search>river</search>", "observation": "obs",
                   "tool_calls": [{"name": "search", "arguments": {"query": "river"}}], "tool_outputs": ["obs"]},
                  {"kind": "answer", "num_tokens": 3, "text": "<answer>Ethai</answer>", "tool_calls": []}],
        "response_ids": [21, 22, 23], "loss_mask": [1, 1, 1], "rollout_logprobs": [-1.0, -0.5, -0.125],
        "actor_logprobs": [-1.0, -0.5, -0.125], "critic_values": [-0.75, 0.625, 1.5], "earlier_segments": [earlier],
    }
    run = tmp_path / "gae_run"
    (run / "trajectories").mkdir(parents=True)
    (run / "trajectories" / "step_000001.jsonl").write_text(json.dumps(record) + "\n")
    (run / "config.json").write_text(json.dumps({"model": {"path": str(tiny_model_dir)}}))
    update_index(run)
    db = open_index(run)
    try:
        written = write_page(db, run, "train", 1)
    finally:
        db.close()
    text = written.path.read_text()
    (section,) = parse_page(text).sections
    values = earlier["critic_values"] + record["critic_values"]
    masks = earlier["loss_mask"] + record["loss_mask"]
    assert len(section["tokens"]) == len(values)
    for token, value, mask in zip(section["tokens"], values, masks):
        assert (f" · value {value:.4f}" in token["title"]) == bool(mask)  # sampled tokens only
    # the facts: the earlier segment's first sampled token comes first
    assert "critic values0.1250 at the first sampled token, min -0.7500, max 1.5000 over 5" in section["text"]


def test_html_without_a_tokenizer_shows_the_turns_text_and_says_so(real_run, tmp_path):
    run = _copy_run(real_run, tmp_path / "no_tokenizer")
    (run / "config.json").write_text(json.dumps({"model": {"path": str(tmp_path / "gone")}}))
    update_index(run)
    db = open_index(run)
    try:
        written = write_page(db, run, "train", None, tmp_path / "page.html")
    finally:
        db.close()
    assert written.steps == [1, 2] and written.trajectories == 16
    assert any("no tokenizer could be loaded" in note for note in written.notes)
    text = written.path.read_text()
    page = parse_page(text)
    records = sorted(read_records(run), key=lambda r: (r["file_step"], r["group_id"], r["sample_index"]))
    for section, record in zip(page.sections, records, strict=True):
        assert section["turns"] == len(record["turns"])
        for turn in record["turns"]:
            assert html.escape(turn["text"]) in text


def test_html_pages_are_capped_with_a_note(real_run, tmp_path, monkeypatch):
    import rlsearch.inspection.page

    run = _copy_run(real_run, tmp_path / "capped")
    (run / "config.json").write_text("{}")  # no tokenizer: this test is about which trajectories are shown
    update_index(run)
    monkeypatch.setattr(rlsearch.inspection.page, "MAX_PAGE_TRAJECTORIES", 10)
    db = open_index(run)
    try:
        latest = write_page(db, run, "train", None)
        one_step = write_page(db, run, "train", 1)
        monkeypatch.setattr(rlsearch.inspection.page, "MAX_PAGE_TRAJECTORIES", 5)
        part_of_a_step = write_page(db, run, "train", 1)
    finally:
        db.close()
    assert (latest.path, latest.steps, latest.trajectories) == (run / "inspect" / "step_000002.html", [2], 8)
    assert "the page shows the latest 1 of 2 steps" in latest.notes[0]
    assert (one_step.path, one_step.trajectories) == (run / "inspect" / "step_000001.html", 8)
    assert part_of_a_step.trajectories == 5
    assert part_of_a_step.notes[0] == "step 1 has 8 trajectories: the page shows the first 5"
    assert len(parse_page(part_of_a_step.path.read_text()).sections) == 5


# ---- the command line ---------------------------------------------------------------------------------------------

def test_cli_prints_the_overview_and_each_headline(real_run):
    result = subprocess.run([sys.executable, "-m", "rlsearch", "inspect", str(real_run)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    print(out)
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("step  trajectories")))
    printed = [line.split() for line in lines[header + 1:header + 3]]
    expected = expected_overview(read_records(real_run))
    assert [[int(cells[0]), int(cells[1]), int(cells[2])] for cells in printed] == [list(row[:3]) for row in expected]
    assert [float(cells[6]) for cells in printed] == [pytest.approx(row[6], abs=5e-4) for row in expected]
    unearned = sum(1 for r in read_records(real_run) if not r["failed"] and r["reward"] > 0 and not r["scores"]["em"])
    assert f"Reward without a correct answer: {unearned} of " in out
    for headline in ("Groups with no reward variance", "Tool errors by tool", "Answers found without searching: 0",
                     "Staleness per step", "--question ID_OR_TEXT"):
        assert headline in out


def test_cli_queries_and_bad_arguments(real_run, capsys):
    example = read_records(real_run)[0]
    assert main(["inspect", str(real_run), "--question", example["example_id"], "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{example['example_id']}: {example['question']}" in out
    assert main(["inspect", str(real_run), "--query", "staleness", "--step", "2"]) == 0
    assert re.search(r"^\s+2\s+1\s+8\s+1\.000$", capsys.readouterr().out, re.MULTILINE)
    assert main(["inspect", str(real_run), "--step", "9"]) == 2
    assert "no train trajectories at step 9; steps 1-2" in capsys.readouterr().err
    assert main(["inspect", str(real_run), "--query", "question"]) == 2
    assert "--query question needs --question" in capsys.readouterr().err
    assert main(["inspect", str(real_run.parent / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["inspect", "--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:" in help_text and all(name in help_text for name in QUERY_NAMES)
