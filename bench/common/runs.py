"""Running the trainer as a user does and reading what it prints: its step lines, its process tree, its assets."""

from __future__ import annotations

import queue
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO_ROOT / "examples" / "configs" / "search_grpo_tiny.yaml"
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|")
BUSY_LINES = ("[rlsearch] checkpoint saved", "[rlsearch] eval after step")


@dataclass
class StepLine:
    step: int
    total: int
    seconds: float  # since the run started
    busy: bool = False  # a checkpoint or an eval followed it (the driver prints a line for each)


def tiny_assets(out: Path, vocab_ranks: int) -> tuple[Path, Path, Path]:
    """The tiny random Qwen2 and the toy data under `out`, built once (the same ones bench/step.py uses): (model,
    train file, corpus)."""
    from bench.common import build_model
    from rlsearch.data import make_toy_data

    model = build_model("tiny", out, vocab_ranks=vocab_ranks)
    toy = make_toy_data(out / "toy", seed=0)
    return model, toy.train, toy.corpus


def read_trainer_output(stream: TextIO, log_path: Path, events: queue.Queue, started: float,
                        echo: tuple[str, ...] = ("[rlsearch]",)) -> None:
    """Copy the trainer's output to `log_path`, echo its step lines and those starting with `echo`, queue a StepLine
    per step line (marked busy when a checkpoint or eval line follows it); None at EOF."""
    last: StepLine | None = None
    with log_path.open("w") as log:
        for line in stream:
            log.write(line)
            log.flush()
            match = STEP_LINE.match(line)
            if match:
                last = StepLine(int(match.group(1)), int(match.group(2)), time.monotonic() - started)
                events.put(last)
            elif last and line.startswith(BUSY_LINES):
                last.busy = True
            if match or line.startswith(echo):
                print(f"  | {line.rstrip()}", flush=True)
    events.put(None)


def describe_process(process: psutil.Process) -> str:
    """A label that stays the same over the process's life: its title for Ray workers and vLLM's EngineCore with
    the running method cut off (`ray::RolloutWorker.generate` -> `ray::RolloutWorker`), `python -m MODULE`,
    `python -c MODULE` (what the code imports) or the program and script names otherwise."""
    cmdline = [arg for arg in process.cmdline() if arg]
    if not cmdline:
        return process.name()
    first = cmdline[0].split(" ")[0]
    if "::" in first:  # a process title (setproctitle)
        head, _, rest = first.partition("::")
        return f"{head}::{rest.split('.')[0].split('(')[0]}"
    program = Path(first).name
    if "-m" in cmdline[1:-1]:
        return f"{program} -m {cmdline[cmdline.index('-m') + 1]}"
    if "-c" in cmdline[1:-1]:  # e.g. multiprocessing's helpers: `from multiprocessing.resource_tracker import main...`
        code = cmdline[cmdline.index("-c") + 1]
        imported = re.match(r"from ([\w.]+) import", code)
        return f"{program} -c {imported.group(1) if imported else code[:30]}"
    script = next((Path(arg).name for arg in cmdline[1:] if arg.endswith(".py")), "")
    return f"{program} {script}".strip()


def process_tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def measure(process: psutil.Process) -> tuple[str, int, int, list] | None:
    """(label, RSS bytes, open fds, inet sockets), or None when the process is gone."""
    try:
        with process.oneshot():
            return (describe_process(process), process.memory_info().rss, process.num_fds(),
                    process.net_connections(kind="inet"))
    except psutil.Error:
        return None


def kill_processes(processes: list[psutil.Process], grace_s: float = 10.0) -> None:
    processes = list({process.pid: process for process in processes}.values())
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, still_alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in still_alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still_alive, timeout=grace_s)
