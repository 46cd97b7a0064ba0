"""Does a run of `bash examples/run_search_grpo.sh` agree with the README's block of what it prints?

A run's sample path depends on the CPU: two CPUs' kernels round differently, a sampled token differs now and then and
the runs part ways after a few steps (docs/testing.md, "The README check"). So the check compares what the code decides
exactly and what the run learns as claims:
- the words of every line, exactly (figures masked): the README shows today's lines;
- the figures that are properties of the code, exactly: which steps are printed and of how many, the warm start's
  steps and examples, the engines and placement, the steps trained, the summary's paths, the paid-API and judge calls
  (none in the default run), the first 10 vs last 10 steps' window;
- the learning claims, on the run and on the README alike: EM 0 on every line, the reward of the last 10 steps above
  the first 10's, invalid calls falling, the SFT loss falling, every logprob mismatch under MISMATCH_LIMIT, the tool
  calls per 1,000 trajectories in TOOLS_PER_1000, and each line's figures in their range (a reward in [0, 1], at most
  MAX_TURNS turns, ...); the summary's final figures are step 30's.
`check(log, readme)` returns None when they agree, else the first line and figure that does not.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

COMMAND = "$ bash examples/run_search_grpo.sh"
# what a run prints before the README's block starts: the set-up of a fresh clone and the assets it builds once; and
# the progress lines of a long step (scripts/common.sh's quietly), as many as the CPU takes time
NOT_SHOWN = ("[setup]", "[rlsearch] building", "[rlsearch]   ... ")
TIMES = (
    (re.compile(r"\btime [\d.]+s\b"), "time *s"),
    (re.compile(r"\bin [\d.]+ s\b"), "in * s"),
    (re.compile(r"^\[rlsearch\] started in .*$"), "[rlsearch] started in *"),
    (re.compile(r"\bnode [0-9a-f]{8} \([\d.]+\)"), "node * (*)"),
)
FIGURE = re.compile(r"[-+]?\d+\.?\d*(?:e[-+]\d+)?")
NAMED = re.compile(r"(reward|EM|turns|tool calls|calls|invalid|len|loss|mismatch|max \|diff\||tools) "
                   r"([-+]?[\d.]+(?:e[-+]\d+)?)")
# a measured figure, with the "-> last" of a first-to-last pair: what differs between CPUs and runs
MEASURED = re.compile(NAMED.pattern + r"(?: -> [-+]?[\d.]+)?")
RUN_DIR = re.compile(r"^  trajectories     : (\S+)/trajectories ")
SFT_DIR = re.compile(r"^\[rlsearch\] warm start: SFT .* \(once, into (\S+)\) \.\.\.$")

# The engine-vs-actor logprob gap of the sampled tokens, fp32, before and after each sync: at most 2.2e-04 over 30
# steps on the README's CPU, 6.3e-04 on a 2-core AMD EPYC with AVX2 (issue 61's run): the limit is 1.6x the largest
# seen (the trainer's own stop, weights.max_logprob_mismatch, is 2e-3 for fp32)
MISMATCH_LIMIT = 1e-3
# tool calls per 1,000 trajectories over the 30 steps: 784.4 and 786.5 (two runs, the README's CPU), 895.8 (the AMD
# EPYC), and bench/default_run.py's seeds (docs/benchmarks.md): the band is the seeds' range widened by half of it
TOOLS_PER_1000 = (550.0, 1150.0)
MAX_TURNS = 3  # rollout.max_turns of examples/configs/search_grpo_tiny.yaml
# each figure of a step line (and of the summary's final line) lies in its range on any run
RANGES = {"reward": (0.0, 1.0), "EM": (0.0, 0.0), "turns": (1.0, MAX_TURNS), "calls": (0.0, MAX_TURNS),
          "tool calls": (0.0, MAX_TURNS), "invalid": (0.0, MAX_TURNS), "len": (1.0, math.inf),
          "loss": (-math.inf, math.inf), "mismatch": (0.0, MISMATCH_LIMIT)}


class Disagreement(Exception):
    """The first line and figure where a run and the README part."""


def readme_block(readme: str) -> list[str]:
    """The lines of the README's default-run block, after its command line."""
    lines = readme.splitlines()
    start = lines.index(COMMAND) + 1
    return lines[start:lines.index("```", start)]


def run_lines(log: str) -> list[str]:
    """What a run printed, as the README shows it: the set-up lines before the block left out."""
    return [line.rstrip() for line in log.splitlines() if line.strip() != COMMAND and not line.startswith(NOT_SHOWN)]


def check(log: str, readme: str) -> str | None:
    """None when `log` (what `bash examples/run_search_grpo.sh` printed) agrees with `readme`'s block, else what the
    first disagreement is: the line and the figure."""
    try:
        compare(run_lines(log), readme_block(readme))
    except Disagreement as disagreement:
        return str(disagreement)
    return None


def compare(run: list[str], shown: list[str]) -> None:
    """Raises Disagreement at the first line of `run` that does not agree with the README's `shown`."""
    run, shown = as_shown(run, paths_of(run), paths_of(shown)), as_shown(shown, {}, {})
    if len(run) != len(shown):
        raise Disagreement(f"the run printed {len(run)} lines where the README shows {len(shown)}:\n"
                           + "\n".join(run))
    for number, (ran, readme) in enumerate(zip(run, shown), start=1):
        if words(ran) != words(readme):
            raise Disagreement(f"line {number} reads\n  {ran}\nwhere the README shows\n  {readme}")
    for source, lines in (("the run", run), ("the README", shown)):
        claims(source, lines)
    for number, (ran, readme) in enumerate(zip(run, shown), start=1):
        for figure, (value, readme_value) in enumerate(zip(exact_figures(ran), exact_figures(readme)), start=1):
            if value != readme_value:
                raise Disagreement(f"line {number}, figure {figure}: {value} where the README shows {readme_value} "
                                   f"(a property of the code, equal on every machine)\n  run:    {ran}\n"
                                   f"  README: {readme}")


def paths_of(lines: list[str]) -> dict[str, str]:
    """The run's own directories, by what they are: the run's output and the warm start's."""
    found = {}
    for line in lines:
        for name, pattern in (("run", RUN_DIR), ("sft", SFT_DIR)):
            if match := pattern.match(line):
                found[name] = match[1]
    return found


def as_shown(lines: list[str], paths: dict[str, str], readme_paths: dict[str, str]) -> list[str]:
    """`lines` with the times and node masked and the run's directories (`paths`) put as the README shows them."""
    out = []
    for line in lines:
        for name in sorted(paths, key=lambda name: -len(paths[name])):  # the longer path first: one may hold another
            if name in readme_paths:
                line = line.replace(paths[name], readme_paths[name])
        for pattern, mask in TIMES:
            line = pattern.sub(mask, line)
        out.append(line)
    return out


def words(line: str) -> str:
    return FIGURE.sub("#", line)


def is_step(line: str) -> bool:
    return line.startswith("step ")


def exact_figures(line: str) -> list[str]:
    """The figures of `line` that the code decides: all but the measured ones (MEASURED: a reward, a loss, a gap, a
    count per trajectory; the claims check those) and the masked times."""
    return FIGURE.findall(MEASURED.sub("", line))


def claims(source: str, lines: list[str]) -> None:
    """What the README says of the run, checked on `lines` (a run's or the README's own)."""
    def fail(line: str, what: str) -> None:
        raise Disagreement(f"{source}: {what}\n  {line}")

    steps = [line for line in lines if is_step(line)]
    for line in steps:
        for name, value in NAMED.findall(line):
            low, high = RANGES[name]
            if not low <= float(value) <= high:
                fail(line, f"{name} {value} outside [{low:g}, {high:g}]")
    for line in lines:
        if line.startswith("[rlsearch] warm start: ") and " loss " in line:
            first, last = (float(value) for value in re.search(r"loss ([\d.]+) -> ([\d.]+)$", line).groups())
            if not last < first / 2:
                fail(line, f"the warm start's loss {first} -> {last} did not fall below half")
        elif line.startswith("[rlsearch] engine vs actor"):
            gap = float(re.search(r"max \|diff\| (\S+) ", line)[1])
            if not gap < MISMATCH_LIMIT:
                fail(line, f"the logprob gap before training {gap:g} is not under {MISMATCH_LIMIT:g}")
        elif line.startswith("  final reward"):
            final = dict(NAMED.findall(line))
            last_step = dict(NAMED.findall(steps[-1])) if steps else {}
            for name, step_name in (("reward", "reward"), ("EM", "EM"), ("turns", "turns"), ("tool calls", "calls")):
                if final[name] != last_step.get(step_name):
                    fail(line, f"the final {name} {final[name]} is not the last step's {last_step.get(step_name)}")
        elif line.startswith("  over the run"):
            figures = re.search(r"reward ([\d.]+) -> ([\d.]+), invalid calls ([\d.]+) -> ([\d.]+)", line).groups()
            first, last, invalid_first, invalid_last = (float(value) for value in figures)
            if not last > first:
                fail(line, f"the reward of the last steps {last} is not above the first steps' {first}")
            if not invalid_last < invalid_first:
                fail(line, f"invalid calls {invalid_first} -> {invalid_last} did not fall")
        elif line.startswith("  calls out"):
            tools = float(dict(NAMED.findall(line))["tools"])
            if not TOOLS_PER_1000[0] <= tools <= TOOLS_PER_1000[1]:
                fail(line, f"tools per 1,000 trajectories {tools} outside the band the bench measured, "
                           f"{TOOLS_PER_1000[0]:g}-{TOOLS_PER_1000[1]:g}")


def check_file(log: Path, readme: Path) -> int:
    """`bench/default_run.py --check-readme LOG`: 0 and a line when LOG agrees with the README, 1 and the first
    disagreement when it does not."""
    problem = check(log.read_text(), readme.read_text())
    if problem:
        print(f"{log} does not agree with {readme}: {problem}")
        return 1
    print(f"{log} agrees with {readme}: the same lines, the code's figures equal, the README's claims hold")
    return 0
