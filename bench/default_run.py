"""Does the default run learn? `bash examples/run_search_grpo.sh` over seeds against a frozen policy.

See docs/benchmarks.md#default_run."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import parse_args  # noqa: E402
from bench.readme_check import check_file  # noqa: E402
from rlsearch.runlog import read_scalars  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
METRICS = (  # label, scalar
    ("reward", "reward/mean"),
    ("valid search", "reward/valid_search_rate"),
    ("invalid calls", "rollout/invalid_calls_mean"),
    ("answered", "reward/answer_rate"),
)


def run_default(out: Path, seed: int, sft_dir: Path, sft_steps: int, *overrides: str) -> tuple[int, float]:
    """One `bash examples/run_search_grpo.sh` into `out` (its SFT warm start `sft_steps` long, 0: the script's);
    returns (terminal lines, seconds). Reused when finished."""
    log = out.with_suffix(".log")
    if (out / "tensorboard" / "curves.png").is_file() and log.is_file():
        return len(log.read_text().splitlines()), float("nan")
    env = {**os.environ, "RLSEARCH_WARM_START": "sft", "RLSEARCH_SFT_DIR": str(sft_dir),
           "RLSEARCH_SFT_OVERRIDES": f"seed={seed}" + (f" data.max_steps={sft_steps}" if sft_steps else "")}
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run's: trainer.resume=none refuses another run's dir
    with log.open("w") as terminal:
        code = subprocess.call(
            ["bash", "examples/run_search_grpo.sh", f"trainer.output_dir={out}", f"trainer.seed={seed}",
             "trainer.resume=none", *overrides],
            cwd=REPO, env=env, stdout=terminal, stderr=subprocess.STDOUT,
        )
    if code:
        raise SystemExit(f"the default run failed (exit {code}): see {log}")
    return len(log.read_text().splitlines()), time.perf_counter() - started


def first_last(run: Path) -> dict[str, tuple[float, float]]:
    """Per metric label: the mean of the first and of the last third of the steps."""
    scalars = read_scalars(run / "tensorboard")
    result = {}
    for label, tag in METRICS:
        values = [value for _, value in scalars[tag]]
        third = max(1, len(values) // 3)
        result[label] = (statistics.fmean(values[:third]), statistics.fmean(values[-third:]))
    return result


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:+.3f}"
    std = statistics.stdev(values)
    t = mean / (std / len(values) ** 0.5) if std > 0 else float("inf")
    return f"{mean:+.3f} ({std:.3f}), t {t:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="skip the actor.lr=0 runs (the baseline the gain is compared with)")
    parser.add_argument("--out", default="outputs/bench/default-run")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra override of every run (repeatable), e.g. trainer.total_steps=20")
    parser.add_argument("--sft-steps", type=int, default=0,
                        help="steps of each seed's SFT warm start (0: the run script's, 60)")
    parser.add_argument("--check-readme", type=Path, metavar="LOG",
                        help="run nothing: check that LOG, what `bash examples/run_search_grpo.sh` printed, agrees "
                             "with the README's block (exit 0), or name the first line and figure that does not (1)")
    args = parse_args(parser, dict(seeds=1, control=False, override=["trainer.total_steps=2", "data.batch_size=2"],
                                   sft_steps=2))
    if args.check_readme:
        raise SystemExit(check_file(args.check_readme, REPO / "README.md"))
    root = (REPO / args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)

    gains: dict[str, list[float]] = {"learn": [], "control": []}
    for seed in range(1, args.seeds + 1):
        kinds = [("learn", ())] + ([("control", ("actor.lr=0",))] if args.control else [])
        for kind, extra in kinds:
            run = root / f"seed_{seed}" / kind
            run.parent.mkdir(parents=True, exist_ok=True)
            lines, seconds = run_default(run, seed, root / f"seed_{seed}" / "sft", args.sft_steps, *args.override,
                                         *extra)
            figures = first_last(run)
            gains[kind].append(figures["reward"][1] - figures["reward"][0])
            cells = " | ".join(f"{label} {a:.3f} -> {b:.3f}" for label, (a, b) in figures.items())
            print(f"seed {seed} {kind:<7} | {cells} | {lines} terminal lines | {seconds:.0f} s", flush=True)

    print(f"reward gain (last third - first third), mean (std) over {args.seeds} seeds: "
          f"learning {spread(gains['learn'])}" + (f"; control (lr 0) {spread(gains['control'])}" if args.control
                                                  else ""))
    if args.control:
        paired = [learn - control for learn, control in zip(gains["learn"], gains["control"])]
        print(f"learning gain over the control's, paired by seed: {spread(paired)}")


if __name__ == "__main__":
    main()
