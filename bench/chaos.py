"""Chaos: a training run whose components are killed with SIGKILL; recoveries, prompts trained once, hangs.

See docs/benchmarks.md#chaos."""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, parse_args, runs  # noqa: E402
from bench.common.table import print_table  # noqa: E402

COMPONENTS = ("engine", "actor", "driver", "retriever", "mcp", "judge")
JUDGE_RESTART_S = 2.0
MiB = 2**20
KILL_COLUMNS = (("kill", ">4"), ("component", "<10"), ("after step", ">11"), ("next step line", ">15"),
                ("recovered in", ">13"))


# ---- the judge: a scripted OpenAI-compatible server, run as a process of its own -------------------------------------

class _JudgeHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        verdict = "correct" if sum(prompt.encode()) % 3 == 0 else "incorrect"  # a verdict that varies by prompt
        reply = json.dumps({"id": "chaos", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": verdict}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def serve_judge(port: int) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), _JudgeHandler).serve_forever()


class JudgeProcess:
    def __init__(self) -> None:
        with socket.socket() as probe:  # a free port, kept across restarts
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process: subprocess.Popen | None = None
        self.killed_at = 0.0  # monotonic

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--serve-judge", str(self.port)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the judge server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


# ---- the run --------------------------------------------------------------------------------------------------------

def write_config(args: argparse.Namespace, run_dir: Path, judge_port: int) -> Path:
    """The run's config: the tiny call_tool setup with 2 engines, async rollouts, the stdio MCP server and the judge."""
    model, train, corpus = runs.tiny_assets(Path(args.out), args.vocab_ranks)
    # a kill every `every` step lines; a resumed driver repeats the steps after its checkpoint, so steps run out last
    steps = args.warmup + args.kills * args.every + args.tail
    mcp_command = [sys.executable, "-m", "rlsearch", "serve-mcp", "--transport", "stdio", "--corpus", str(corpus),
                   "--cache-dir", str(Path(args.out) / "bm25_cache")]
    config = {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train_files": [str(train)], "batch_size": 4},
        "rollout": {
            "protocol": "call_tool", "group_size": 4, "max_turns": 3, "max_response_tokens": 400,
            "max_tokens_per_turn": 96, "assistant_prefix": '<call_tool name="search">',
            "logit_bias": {"</call_tool>": 16.0}, "num_engines": 2, "kv_cache_gib": 1, "async_steps": 1,
            "update_weights_in_flight": True,
        },
        "tools": {
            "enabled": ["search"],
            "mcp": {"servers": [{"command": mcp_command, "allow": ["browse"]}], "timeout_s": 20},
            "retriever": {"corpus": str(corpus), "index_cache_dir": str(Path(args.out) / "bm25_cache")},
        },
        # a search earns a little reward (the random model rarely answers): the groups' rewards differ, so every step
        # updates the weights and syncs them
        "reward": {"scorers": {"toy": "judge"}, "search_score": 0.1,
                   "judge": {"base_url": f"http://127.0.0.1:{judge_port}/v1", "model": "chaos-judge", "timeout_s": 20}},
        "actor": {"lr": 1e-4},
        "trainer": {"total_steps": steps, "save_interval": args.save_interval, "keep_checkpoints": 2,
                    "print_interval": 1, "output_dir": str(run_dir), "resume": "none", "seed": args.seed,
                    "max_actor_restarts": args.kills},  # every rank kill recovered in the driver
    }
    path = run_dir / "chaos.yaml"
    path.write_text(json.dumps(config, indent=1))  # JSON is YAML
    return path


@dataclass
class Kill:
    component: str
    label: str
    pid: int
    seconds: float  # since the run started
    last_step: int  # the last step line before it
    recovered_s: float | None = None  # to the next step line
    next_step: int | None = None


def victims(component: str, supervisor: psutil.Process) -> list[psutil.Process]:
    """The processes of the run that `component` names (the driver: the supervisor's `rlsearch train` child; its other
    children are the Ray instance it owns)."""
    if component == "driver":
        return [child for child in supervisor.children() if _command_line(child)[1:4] == ["-m", "rlsearch", "train"]]
    wanted = {"engine": "ray::RolloutWorker", "actor": "ray::MegatronActorWorker",
              "retriever": "rlsearch.tools.servers.retrieval", "mcp": "serve-mcp"}[component]
    found = []
    for process in runs.process_tree(supervisor)[1:]:
        command = " ".join(_command_line(process))
        if wanted in command and not (component == "engine" and "EngineCore" in command) and \
                not _forked_by_a_worker(process, wanted):
            found.append(process)
    return found


def _command_line(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _forked_by_a_worker(process: psutil.Process, title: str) -> bool:
    """A child a Ray worker forked (Megatron's checkpoint writers) carries its title: not the worker itself."""
    try:
        parent = process.parent()
        return parent is not None and title in " ".join(parent.cmdline())
    except psutil.Error:
        return False


def rss_by_kind(supervisor: psutil.Process, judge: JudgeProcess) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {}
    processes = runs.process_tree(supervisor)
    if judge.process.poll() is None:  # a killed judge is down until it is started again
        processes.append(psutil.Process(judge.process.pid))
    for process in processes:
        measured = runs.measure(process)
        if measured is not None:
            label = "supervisor" if process.pid == supervisor.pid else measured[0]
            kinds.setdefault(label, []).append(measured[1])
    return kinds


def run_chaos(args: argparse.Namespace, run_dir: Path) -> tuple[list[Kill], list[tuple[float, int]], dict, dict, str,
                                                                 int | None]:
    rng = random.Random(args.seed)
    judge = JudgeProcess()
    judge.start()
    config = write_config(args, run_dir, judge.port)
    command = [sys.executable, "-m", "rlsearch", "train", "--restarts", str(args.kills + 5), "--config", str(config),
               *args.overrides]
    started = time.monotonic()
    run = subprocess.Popen(command, cwd=runs.REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    supervisor = psutil.Process(run.pid)
    events: queue.Queue = queue.Queue()
    reader = threading.Thread(target=runs.read_trainer_output, daemon=True,
                              args=(run.stdout, run_dir / "train.log", events, started))
    reader.start()
    kills: list[Kill] = []
    steps: list[tuple[float, int]] = []
    rss_start: dict = {}
    rss_end: dict = {}
    hang = ""
    next_kill_after = args.warmup  # step lines before the first kill
    lines_since_kill = 0
    try:
        while True:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                event = ""
            if event is None:
                break
            now = time.monotonic() - started
            if event:
                steps.append((event.seconds, event.step))
                lines_since_kill += 1
                if not rss_start:
                    rss_start = rss_by_kind(supervisor, judge)
                rss_end = rss_by_kind(supervisor, judge)
                pending = [k for k in kills if k.recovered_s is None]
                for kill in pending:
                    kill.recovered_s, kill.next_step = event.seconds - kill.seconds, event.step
            last_progress = steps[-1][0] if steps else 0.0
            limit = args.hang_timeout if steps else args.startup_timeout
            if now - last_progress > limit:
                hang = f"no step line for {now - last_progress:.0f} s (limit {limit:.0f} s)"
                break
            if judge.process.poll() is not None and time.monotonic() - judge.killed_at >= JUDGE_RESTART_S:
                judge.start()  # the external service comes back
            if len(kills) < args.kills and event and lines_since_kill >= next_kill_after:
                time.sleep(rng.uniform(0, 5))
                kill = _kill_one(rng, args.components, supervisor, judge, steps[-1][1], time.monotonic() - started)
                if kill is not None:
                    kills.append(kill)
                    lines_since_kill, next_kill_after = 0, args.every
    except KeyboardInterrupt:
        hang = "interrupted (Ctrl-C)"
    if hang:
        print(f"chaos: {hang}: killing the run", flush=True)
        runs.kill_processes(runs.process_tree(supervisor))
    returncode = run.wait()
    reader.join(timeout=10)
    judge.stop()
    return kills, steps, rss_start, rss_end, hang, returncode


def _kill_one(rng: random.Random, components: list[str], supervisor: psutil.Process, judge: JudgeProcess,
              last_step: int, seconds: float) -> Kill | None:
    component = rng.choice(components)
    if component == "judge":
        if judge.process.poll() is not None:
            return None
        pid = judge.process.pid
        judge.process.kill()
        judge.process.wait()
        judge.killed_at = time.monotonic()
        label = "judge server"
    else:
        found = victims(component, supervisor)
        if not found:
            print(f"chaos: no {component} process to kill now; drawing again at the next step", flush=True)
            return None
        victim = rng.choice(found)
        pid, label = victim.pid, (runs.measure(victim) or (component,))[0]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
    print(f"chaos: kill {component} ({label}, pid {pid}) after step {last_step}", flush=True)
    return Kill(component, label, pid, seconds, last_step)


# ---- the records ----------------------------------------------------------------------------------------------------

def prompt_counts(run_dir: Path, last_step: int) -> tuple[int, int, int, int]:
    """(trained as often as the sampler's order holds them, skipped, duplicated, expected) over the (question,
    sample) pairs of the sampler's order for steps 1..last_step (a question recurs once per epoch), read from the
    run's trajectory records."""
    from rlsearch.data import load_qa_dataset
    from rlsearch.trainer.sampler import EpochSampler

    config = json.loads((run_dir / "config.json").read_text())
    batch_size, group_size = config["data"]["batch_size"], config["rollout"]["group_size"]
    examples = [e for path in config["data"]["train_files"] for e in load_qa_dataset(path)]
    order = EpochSampler(examples, config["trainer"]["seed"], config["data"]["shuffle"]).next_batch(
        last_step * batch_size)
    expected = Counter((e.id, sample) for e in order for sample in range(group_size))
    seen: Counter = Counter()
    for step in range(1, last_step + 1):
        path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
        if path.exists():
            for line in path.open():
                record = json.loads(line)
                seen[(record["example_id"], record["sample_index"])] += 1
    once = sum(min(seen[key], want) for key, want in expected.items())
    skipped = sum(max(0, want - seen[key]) for key, want in expected.items())
    duplicated = sum(max(0, count - expected.get(key, 0)) for key, count in seen.items())
    return once, skipped, duplicated, sum(expected.values())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--every", type=int, default=2, help="completed steps between two kills")
    parser.add_argument("--warmup", type=int, default=2, help="completed steps before the first kill")
    parser.add_argument("--components", type=lambda s: s.split(","), default=list(COMPONENTS),
                        help="comma-separated, from " + ",".join(COMPONENTS))
    parser.add_argument("--tail", type=int, default=4,
                        help="steps after the last kill's: a killed driver or rank rewinds to its checkpoint, a "
                             "killed tool server is started again before the next rollout (the smoke run: 2)")
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--recovery-goal", type=float, default=60.0,
                        help="seconds from a kill to the next step line (the smoke run, on a loaded test machine, "
                             "checks that it recovers, not how fast: 600)")
    parser.add_argument("--out", default="outputs/bench", help="assets are cached here; the run goes to OUT/chaos")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the trainer")
    add_vocab_ranks_argument(parser)
    return parser


def report(args: argparse.Namespace, run_dir: Path, kills: list[Kill], steps: list[tuple[float, int]], rss_start: dict,
           rss_end: dict, hang: str, returncode: int | None) -> int:
    """The kills, the processes' memory, what the run printed of its recoveries, and the verdict: 1 on a failure."""
    print()
    print_table(KILL_COLUMNS, ([index, kill.component, kill.last_step, kill.next_step or "-",
                                "never" if kill.recovered_s is None else f"{kill.recovered_s:.1f} s"]
                               for index, kill in enumerate(kills, 1)), rule=False)
    last_step = max((step for _, step in steps), default=0)
    once, skipped, duplicated, expected = prompt_counts(run_dir, last_step) if last_step else (0, 0, 0, 0)
    print("\nRSS by kind of process, MiB (count): first step line -> last step line")
    for kind in sorted(set(rss_start) | set(rss_end)):
        before, after = rss_start.get(kind, []), rss_end.get(kind, [])
        print(f"  {kind:45s} {sum(before) / MiB:8.0f} ({len(before)}) -> {sum(after) / MiB:8.0f} ({len(after)})")
    recoveries = [k for k in kills if k.recovered_s is not None]
    worst = max(recoveries, key=lambda k: k.recovered_s, default=None)
    by_component = Counter(k.component for k in kills)
    restarts = run_dir / "logs" / "restarts.log"
    print(f"\nrun: exit status {returncode}, {last_step} steps, "
          f"{len(restarts.read_text().splitlines()) if restarts.exists() else 0} driver restarts, "
          f"{(steps[-1][0] if steps else 0) / 60:.1f} min to the last step line")
    log = (run_dir / "train.log").read_text()
    recoveries_logged = {"engines restarted": log.count("restarted rollout engine"),
                         "actor ranks replaced": log.count("the actor ranks were replaced"),
                         "tool servers started again": log.count("started again on port")}
    print("recoveries the run printed: " + ", ".join(f"{name} {count}" for name, count in recoveries_logged.items()))
    startups = [(float(total), phases) for total, phases in re.findall(r"\[rlsearch\] started in ([\d.]+) s: (.*)",
                                                                        log)]
    if startups:  # the driver's start-up (the first, and one per restart): where a driver kill's recovery goes
        slowest = max(startups)
        print(f"driver start-ups: {len(startups)}, median {statistics.median(t for t, _ in startups):.1f} s; the "
              f"slowest {slowest[0]:.1f} s: {slowest[1]}")
    calls_out = re.findall(r"calls out +: (.*)", log)
    if calls_out:
        print(f"calls out (last run summary): {calls_out[-1]}")
    failures = []
    if hang:
        failures.append(f"hang: {hang}")
    if returncode != 0:
        failures.append(f"the run exited with status {returncode}")
    if skipped or duplicated:
        failures.append(f"{skipped} skipped, {duplicated} duplicated")
    if len(recoveries) < len(kills):
        failures.append(f"{len(kills) - len(recoveries)} kills without a step line after them")
    if worst is not None and worst.recovered_s > args.recovery_goal:
        failures.append(f"longest recovery {worst.recovered_s:.0f} s > {args.recovery_goal:.0f} s")
    print(f"chaos: {len(kills)} kills ({', '.join(f'{c} {n}' for c, n in by_component.most_common())}); "
          f"prompts trained once {once}/{expected}, skipped {skipped}, duplicated {duplicated}; longest recovery "
          + (f"{worst.recovered_s:.1f} s ({worst.component})" if worst else "-")
          + f"; hangs {1 if hang else 0}: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)), flush=True)
    return 1 if failures else 0


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-judge":
        serve_judge(int(sys.argv[2]))
        return
    parser = _parser()
    args = parse_args(parser, dict(kills=1, every=1, warmup=1, tail=2, components=["retriever"], save_interval=1,
                                     recovery_goal=600.0, vocab_ranks=SMOKE_VOCAB_RANKS,
                                     # one small engine: the retriever is the one killed (1.5 GiB instead of 2 x 2.3);
                                     # the random model's turns run to the token limit: 24 tokens, not 96
                                     overrides=["rollout.num_engines=1", "rollout.kv_cache_gib=0.25",
                                                "rollout.max_tokens_per_turn=24"]))
    unknown = set(args.components) - set(COMPONENTS)
    if unknown:
        parser.error(f"unknown components {sorted(unknown)}; choose from {', '.join(COMPONENTS)}")
    run_dir = Path(args.out) / "chaos"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    sys.exit(report(args, run_dir, *run_chaos(args, run_dir)))


if __name__ == "__main__":
    main()
