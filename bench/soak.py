"""Soak test: many GRPO steps of the real trainer, watching each process's RSS, open files and sockets.

See docs/benchmarks.md#soak."""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, parse_args, runs  # noqa: E402
from bench.common.runs import StepLine  # noqa: E402
from bench.common.table import print_table  # noqa: E402

MiB = 2**20
RSS_GOAL = 0.10  # growth of a steady process's RSS after warm-up, as a fraction of its warm-up RSS
TOOL_SERVER = "-m rlsearch.tools.servers."  # in the label of an HTTP tool server the trainer starts (the retriever)


@dataclass
class Sample:
    seconds: float  # since the trainer started
    step: int  # the last step line printed before it
    rss: int
    fds: int
    sockets: int
    keepalive: int  # of the sockets (and the fds): connections with the run's tool servers
    at_step_line: bool  # taken as that step line arrived (else on the timer)


@dataclass
class KeepAliveConnections:
    """A process's connections with the run's tool servers, each by its (local, remote) address, and those leaked: in
    CLOSE_WAIT (its peer closed it) while its process opened a newer one a sample or more later."""

    opened: dict[tuple, int] = field(default_factory=dict)  # -> the sample it was first seen at
    peer_closed: dict[tuple, int] = field(default_factory=dict)  # -> the sample it was first seen in CLOSE_WAIT at
    leaked: set[tuple] = field(default_factory=set)  # (connection, opened): a reused address is another connection

    def observe(self, connections: list, index: int) -> None:
        status = {(connection.laddr, connection.raddr): connection.status for connection in connections}
        self.opened = {key: self.opened.get(key, index) for key in status}
        self.peer_closed = {key: self.peer_closed.get(key, index) for key, state in status.items()
                            if state == psutil.CONN_CLOSE_WAIT}
        newest = max(self.opened.values(), default=index)
        # a sample between: one opened as the server closed the other (the client's request began before) is not one
        self.leaked |= {(key, self.opened[key]) for key, closed in self.peer_closed.items() if newest >= closed + 2}


@dataclass
class TrackedProcess:
    pid: int
    create_time: float
    label: str
    samples: list[Sample] = field(default_factory=list)
    keepalive: KeepAliveConnections = field(default_factory=KeepAliveConnections)

    @property
    def name(self) -> str:
        return f"{self.label} [{self.pid}]"


@dataclass
class ProcessReport:
    name: str
    rss_warm: int
    rss_max_after: int
    rss_end: int
    growth: float  # (end - warm) / warm
    slope_per_100_steps: float  # least-squares slope after warm-up, fraction of the warm-up RSS per 100 steps
    fds_warm: int  # fds and sockets: without the keep-alive connections
    fds_end: int
    sockets_warm: int
    sockets_end: int
    keepalive_most: int  # keep-alive connections held at once, from "warm" to "end"
    keepalive_leaked: int  # over the process's life


# ---- the process tree -----------------------------------------------------------------------------------------------

class ProcessMonitor:
    """Samples the driver and its descendants; a process is keyed by (pid, start time), so a reused pid is new."""

    def __init__(self, driver_pid: int, started: float) -> None:
        self.driver = psutil.Process(driver_pid)
        self.started = started
        self.processes: dict[tuple[int, float], TrackedProcess] = {}

    def sample(self, step: int, at_step_line: bool) -> None:
        now = time.monotonic() - self.started
        measured = [(process, found) for process in runs.process_tree(self.driver) if (found := runs.measure(process))]
        servers = {connection.laddr for _, (label, _, _, sockets) in measured if TOOL_SERVER in label
                   for connection in sockets if connection.status == psutil.CONN_LISTEN}
        for process, (label, rss, fds, sockets) in measured:
            if process.pid == self.driver.pid:
                label = "driver (rlsearch train)"
            try:
                key = (process.pid, process.create_time())
            except psutil.Error:
                continue
            tracked = self.processes.setdefault(key, TrackedProcess(process.pid, key[1], label))
            # the latest: a pooled ray::IDLE worker becomes an actor, EngineCore sets its title after it starts
            tracked.label = label
            keepalive = [connection for connection in sockets if connection.raddr
                         and (connection.raddr in servers or connection.laddr in servers)]
            tracked.keepalive.observe(keepalive, len(tracked.samples))
            tracked.samples.append(Sample(now, step, rss, fds, len(sockets), len(keepalive), at_step_line))

    def alive(self) -> list[psutil.Process]:
        """Every process seen during the run that still runs (the same process: pid and start time match)."""
        alive = []
        for pid, create_time in self.processes:
            try:
                process = psutil.Process(pid)
                if process.create_time() == create_time:
                    alive.append(process)
            except psutil.Error:
                pass
        return alive


# ---- the trainer ----------------------------------------------------------------------------------------------------

def trainer_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    model, train, corpus = runs.tiny_assets(Path(args.out), args.vocab_ranks)
    overrides = [
        f"model.path={model}", f"data.train_files=[{train}]", f"tools.retriever.corpus={corpus}",
        f"tools.retriever.index_cache_dir={Path(args.out) / 'bm25_cache'}", f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={run_dir}", f"trainer.save_interval={args.save_interval}", "trainer.keep_checkpoints=2",
        "trainer.resume=none", "trainer.log_trajectories=false", *args.overrides,
    ]
    return [sys.executable, "-m", "rlsearch", "train", "--config", str(runs.TINY_CONFIG), *overrides]


def hang_timeout(args: argparse.Namespace, steps: list[StepLine]) -> float:
    """Seconds without a new step line that count as a hang."""
    if not steps:
        return args.startup_timeout
    if args.hang_timeout:
        return args.hang_timeout
    times = [0.0] + [line.seconds for line in steps]
    durations = [times[i + 1] - times[i] for i in range(len(steps)) if steps[i].step > 3]
    return max(300.0, 10 * statistics.median(durations)) if durations else 300.0


@dataclass
class RunOutcome:
    steps: list[StepLine]
    seconds: float
    returncode: int | None
    hang: str  # empty: no hang
    left_behind: list[str]


def run_and_monitor(args: argparse.Namespace, command: list[str], run_dir: Path) -> tuple[RunOutcome, ProcessMonitor]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    log_path = run_dir / "train.log"
    events: queue.Queue = queue.Queue()
    steps: list[StepLine] = []
    hang = ""
    started = time.monotonic()
    driver = subprocess.Popen(command, cwd=runs.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1)
    monitor = ProcessMonitor(driver.pid, started)
    reader = threading.Thread(target=runs.read_trainer_output, daemon=True,
                              args=(driver.stdout, log_path, events, started, ("[rlsearch]", "rlsearch")))
    reader.start()
    last_progress = 0.0
    try:
        while True:
            try:
                event = events.get(timeout=args.interval)
            except queue.Empty:
                event = ""
            if event is None or (event == "" and driver.poll() is not None):
                break  # EOF, or the driver exited and a child of it still holds the pipe
            if isinstance(event, StepLine):
                steps.append(event)
                last_progress = event.seconds
            monitor.sample(steps[-1].step if steps else 0, at_step_line=isinstance(event, StepLine))
            now = time.monotonic() - started
            limit = hang_timeout(args, steps)
            if now - last_progress > limit:
                where = f"after step {steps[-1].step}" if steps else "before step 1"
                hang = f"no step line for {now - last_progress:.0f} s {where} (limit {limit:.0f} s)"
                break
    except KeyboardInterrupt:
        hang = "interrupted (Ctrl-C)"
    if hang:
        print(f"soak: {hang}: killing the process tree", flush=True)
        runs.kill_processes(runs.process_tree(monitor.driver) + monitor.alive())
    returncode = driver.wait()
    seconds = time.monotonic() - started
    reader.join(timeout=10)  # the rest of the output into the log (a surviving child may hold the pipe open)
    _, left_behind = psutil.wait_procs(monitor.alive(), timeout=15)  # Ray's processes finish their own shutdown
    names = [tracked.name for tracked in monitor.processes.values()
             if any(p.pid == tracked.pid for p in left_behind)]
    runs.kill_processes(left_behind)
    return RunOutcome(steps, seconds, returncode, hang, names), monitor


# ---- the figures ----------------------------------------------------------------------------------------------------

def reference_lines(steps: list[StepLine], warmup: int) -> tuple[StepLine, StepLine, list[StepLine]] | None:
    """"warm" (the first step line from the end of warm-up on), "end" (the last) and the step lines between them,
    skipping those followed by a checkpoint or an eval; None when fewer than two are left."""
    quiet = [line for line in steps if line.step >= warmup and not line.busy]
    return (quiet[0], quiet[-1], quiet) if len(quiet) >= 2 else None


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if var_x == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x


def report_processes(monitor: ProcessMonitor, lines: list[StepLine],
                     last_line: StepLine) -> tuple[list[ProcessReport], list[TrackedProcess]]:
    """Steady processes (sampled at both the first and the last of `lines`) with their figures; the others apart."""
    reports, transient = [], []
    for tracked in monitor.processes.values():
        at_line = {sample.step: sample for sample in tracked.samples if sample.at_step_line}
        if not all(line.step in at_line for line in (lines[0], lines[-1])):
            transient.append(tracked)
            continue
        line_samples = [at_line[line.step] for line in lines if line.step in at_line]
        warm, end = line_samples[0], line_samples[-1]
        after = [sample.rss for sample in tracked.samples if warm.seconds <= sample.seconds <= last_line.seconds]
        span = [sample for sample in tracked.samples if warm.seconds <= sample.seconds <= end.seconds]
        quarter = max(1, len(span) // 4)  # the floors of open files and sockets at the start and the end of the span
        slope = least_squares_slope([sample.step for sample in line_samples], [sample.rss for sample in line_samples])
        reports.append(ProcessReport(
            name=tracked.name, rss_warm=warm.rss, rss_max_after=max(after), rss_end=end.rss,
            growth=(end.rss - warm.rss) / warm.rss, slope_per_100_steps=100 * slope / warm.rss,
            fds_warm=min(sample.fds - sample.keepalive for sample in span[:quarter]),
            fds_end=min(sample.fds - sample.keepalive for sample in span[-quarter:]),
            sockets_warm=min(sample.sockets - sample.keepalive for sample in span[:quarter]),
            sockets_end=min(sample.sockets - sample.keepalive for sample in span[-quarter:]),
            keepalive_most=max(sample.keepalive for sample in span), keepalive_leaked=len(tracked.keepalive.leaked),
        ))
    reports.sort(key=lambda report: -report.rss_warm)
    return reports, transient


def print_processes(reports: list[ProcessReport], transient: list[TrackedProcess], warm: StepLine,
                    end: StepLine) -> None:
    print(f"\nsteady processes: RSS MiB at step {warm.step} (warm), the most after it, at step {end.step} (end), "
          f"growth, slope in % of warm per 100 steps; fewest open fds and inet sockets, first -> last quarter, "
          f"without the keep-alive connections with the tool servers: the most at once, and those leaked")
    width = max([len(report.name) for report in reports] + [20])
    columns = [("process", f"<{width}"), ("warm", ">8.1f"), ("max", ">8.1f"), ("end", ">8.1f"), ("growth", ">8"),
               ("slope", ">8"), ("fds", ">11"), ("sockets", ">9"), ("keep-alive", ">10"), ("leaked", ">6")]
    total_warm, total_end = sum(r.rss_warm for r in reports), sum(r.rss_end for r in reports)
    print_table(columns, [
        *((r.name, r.rss_warm / MiB, r.rss_max_after / MiB, r.rss_end / MiB, f"{100 * r.growth:+.1f}%",
           f"{100 * r.slope_per_100_steps:+.1f}%", f"{r.fds_warm}->{r.fds_end}", f"{r.sockets_warm}->{r.sockets_end}",
           r.keepalive_most, r.keepalive_leaked) for r in reports),
        ("all steady processes", total_warm / MiB, "", total_end / MiB,
         f"{100 * (total_end - total_warm) / max(total_warm, 1):+.1f}%"),
    ], rule=False)
    if transient:
        print("\nprocesses that came or went (not counted): seen from step -> to step, max RSS MiB")
        for tracked in sorted(transient, key=lambda t: t.samples[0].seconds):
            print(f"{tracked.name:<{width}} {tracked.samples[0].step:>4} -> {tracked.samples[-1].step:<4} "
                  f"{max(s.rss for s in tracked.samples) / MiB:>8.1f}")


def write_samples(path: Path, args: argparse.Namespace, outcome: RunOutcome, monitor: ProcessMonitor,
                  reports: list[ProcessReport]) -> None:
    data = {
        "args": vars(args),
        "outcome": {**asdict(outcome), "steps": [asdict(line) for line in outcome.steps]},
        "processes": {
            tracked.name: {"pid": tracked.pid, "label": tracked.label,
                           "samples": [[round(s.seconds, 2), s.step, s.rss, s.fds, s.sockets, s.keepalive,
                                        s.at_step_line] for s in tracked.samples]}
            for tracked in monitor.processes.values()
        },
        "sample_fields": ["seconds", "step", "rss_bytes", "open_fds", "inet_sockets", "keepalive_connections",
                          "at_step_line"],
        "reports": [asdict(report) for report in reports],
    }
    path.write_text(json.dumps(data, indent=1))


def warmup_steps(args: argparse.Namespace) -> int:
    """--warmup, else 10% of the steps and at least through the first checkpoint: the first save starts a worker
    process that Megatron's dist_checkpointing keeps for later saves (+4 open files in each rank, once)."""
    if args.warmup is not None:
        return args.warmup
    return max(1, args.steps // 10, args.save_interval + 1 if args.save_interval < args.steps else 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="GRPO steps (trainer.total_steps)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps before the reference sample (default: 10%% of the steps, and at least "
                        "through the first checkpoint: 51 of 200)")
    parser.add_argument("--save-interval", type=int, default=50, help="trainer.save_interval (checkpoints)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--hang-timeout", type=float, default=0.0,
                        help="seconds without a step line that count as a hang (default: 10x the median step time "
                             "after step 3, at least 300)")
    parser.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds allowed before step 1")
    parser.add_argument("--out", default="outputs/bench", help="where the model, data, run and samples go")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the trainer (key=value)")
    add_vocab_ranks_argument(parser)
    return parser


def report(args: argparse.Namespace, out: Path, run_dir: Path, outcome: RunOutcome, monitor: ProcessMonitor,
           warmup: int) -> int:
    """The samples written, the processes' table, and the verdict against the goals: 1 on a failure."""
    samples_path = out / "soak-samples.json"
    failures = []
    if outcome.hang:
        failures.append(f"hang: {outcome.hang}")
    elif outcome.returncode != 0:
        failures.append(f"the trainer exited with code {outcome.returncode}")
    if failures:
        tail = (run_dir / "train.log").read_text().splitlines()[-20:]
        print("\n".join(["", "trainer output (last lines):", *tail]))
    if outcome.left_behind:
        print(f"\nprocesses left running after the trainer exited (killed now): {', '.join(outcome.left_behind)}")
    references = reference_lines(outcome.steps, warmup)
    if references is None:
        write_samples(samples_path, args, outcome, monitor, [])
        print(f"soak: FAILED after {len(outcome.steps)} steps in {outcome.seconds:.0f} s, without two step lines "
              f"after warm-up (step {warmup}) to compare: {'; '.join(failures) or 'too few steps'}; samples in "
              f"{samples_path}")
        return 1

    warm, end, lines = references
    reports, transient = report_processes(monitor, lines, outcome.steps[-1])
    write_samples(samples_path, args, outcome, monitor, reports)
    print_processes(reports, transient, warm, end)
    print(f"\nsamples: {samples_path}")

    worst = max(reports, key=lambda report: report.growth)
    fds_growth = sum(max(r.fds_end - r.fds_warm, 0) for r in reports)
    sockets_growth = sum(max(r.sockets_end - r.sockets_warm, 0) for r in reports)
    grew = [r.name for r in reports if r.fds_end > r.fds_warm or r.sockets_end > r.sockets_warm]
    leaked = sum(r.keepalive_leaked for r in reports)
    if worst.growth > RSS_GOAL:
        failures.append(f"RSS of {worst.name} grew {100 * worst.growth:+.1f}%")
    if fds_growth or sockets_growth:
        failures.append(f"open files or sockets grew in {', '.join(grew)}")
    if leaked:
        failures.append(f"keep-alive connections leaked in {', '.join(r.name for r in reports if r.keepalive_leaked)}")
    done = outcome.steps[-1].step
    if done != args.steps and not failures:
        failures.append(f"only {done} of {args.steps} steps ran")
    hang = f"hang ({outcome.hang})" if outcome.hang else "no hang"
    label = worst.name.rsplit(" [", 1)[0]
    print(f"soak: {done} steps in {outcome.seconds:.0f} s, {hang}; max RSS growth after warm-up "
          f"{100 * worst.growth:+.1f}% ({label}, step {warm.step} -> {end.step}) (goal <= {100 * RSS_GOAL:.0f}%); "
          f"open files +{fds_growth}, sockets +{sockets_growth} (goal: no growth); keep-alive connections leaked "
          f"{leaked} (goal: none)"
          + (f"; FAILED: {'; '.join(failures)}" if failures else ""))
    return 1 if failures else 0


def main() -> int:
    parser = _parser()
    args = parse_args(parser, dict(steps=4, warmup=1, save_interval=3, interval=1.0, vocab_ranks=SMOKE_VOCAB_RANKS))
    warmup = warmup_steps(args)
    if not 1 <= warmup < args.steps:
        parser.error(f"--warmup {warmup} must be at least 1 and below --steps {args.steps}")

    out = Path(args.out).resolve()
    args.out = str(out)
    run_dir = out / "soak-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = trainer_command(args, run_dir)
    print(f"soak: {args.steps} GRPO steps on the toy task, warm-up {warmup} steps, a sample every {args.interval:g} s "
          f"and at every step line; trainer output in {run_dir / 'train.log'}", flush=True)
    outcome, monitor = run_and_monitor(args, command, run_dir)
    return report(args, out, run_dir, outcome, monitor, warmup)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed soak cleans up its process tree
    sys.exit(main())
