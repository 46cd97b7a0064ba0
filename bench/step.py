"""One full GRPO step of the real trainer on a 0.5B-shaped random model, broken down by phase.

See docs/benchmarks.md#step."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, build_model, parse_args  # noqa: E402
from bench.common.runs import TINY_CONFIG  # noqa: E402
from bench.common.table import print_table  # noqa: E402

PHASES = (
    ("rollout wait", "time/rollout_s"),
    ("generate/traj", "time/generate_s_mean"),
    ("tool wait/traj", "time/tool_wait_s_mean"),
    ("reward", "time/reward_s"),
    ("algo", "time/algo_s"),
    ("ref logprobs", "time/ref_logprob_s"),
    ("train", "time/train_s"),
    ("sync", "time/sync_s"),
    ("engine idle", "time/engine_idle_s"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--steps", type=int, default=2, help="training steps (the last one is reported)")
    parser.add_argument("--batch-size", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--async-steps", type=int, default=0, help="rollout.async_steps (0: on-policy)")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the reference model's forward pass")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench", help="where the random model, data and the run go")
    add_vocab_ranks_argument(parser)
    return parser


def run(args: argparse.Namespace) -> dict[str, list[tuple[int, float]]]:
    """The GRPO run; its TensorBoard scalars."""
    from rlsearch.config import load_train_config
    from rlsearch.data import make_toy_data
    from rlsearch.runlog import read_scalars
    from rlsearch.trainer import GRPOTrainer

    out = Path(args.out)
    model = build_model(args.shape, out, vocab_ranks=args.vocab_ranks)
    toy = make_toy_data(out / "toy", seed=0)
    run_dir = out / f"step-{args.shape}-tp{args.tp}pp{args.pp}-async{args.async_steps}"
    shutil.rmtree(run_dir, ignore_errors=True)  # the last measurement's: trainer.resume=none refuses another run's dir
    config = load_train_config(str(TINY_CONFIG), [
        f"model.path={model}", f"data.train_files=[{toy.train}]", f"tools.retriever.corpus={toy.corpus}",
        f"tools.retriever.index_cache_dir={out / 'bm25_cache'}", f"data.batch_size={args.batch_size}",
        f"rollout.group_size={args.group_size}", f"rollout.max_response_tokens={args.max_response_tokens}",
        f"rollout.async_steps={args.async_steps}", f"algo.kl_coef={args.kl_coef}", f"actor.tp={args.tp}",
        f"actor.pp={args.pp}", f"trainer.total_steps={args.steps}", f"trainer.output_dir={run_dir}",
        "trainer.resume=none", "trainer.log_trajectories=false", "trainer.save_interval=0",
        "trainer.keep_checkpoints=1",
    ])
    print(f"GRPO steps on a random {args.shape}-shaped Qwen2, {args.batch_size} prompts x {args.group_size} samples, "
          f"tp{args.tp} pp{args.pp}, async_steps {args.async_steps}", flush=True)
    return read_scalars(GRPOTrainer(config).train().tensorboard_dir)


def report(args: argparse.Namespace, scalars: dict[str, list[tuple[int, float]]]) -> None:
    """Every step's phases, then the last step's shares of its wall time."""
    steps = sorted(step for step, _ in scalars["time/step_s"])
    by_step = {step: {tag: dict(values).get(step, 0.0) for tag, values in scalars.items()} for step in steps}
    columns = [("step", ">4"), ("wall s", ">8.1f"), *((label, ">13.1f") for label, _ in PHASES), ("tokens", ">7.0f")]
    print_table(columns, [
        (step, row["time/step_s"], *(row.get(tag, 0.0) for _, tag in PHASES),
         row.get("rollout/response_len_mean", 0.0) * args.batch_size * args.group_size)
        for step, row in by_step.items()
    ], rule=False)
    last = by_step[steps[-1]]
    wall = last["time/step_s"]
    trainer_phases = [(label, tag) for label, tag in PHASES if "/traj" not in label and label != "engine idle"]
    shares = [(label, last.get(tag, 0.0) / wall) for label, tag in trainer_phases]
    other = 1.0 - sum(share for _, share in shares)
    print(f"step {steps[-1]} ({wall:.1f} s) shares: "
          + ", ".join(f"{label} {share:.2f}" for label, share in shares)
          + f", other {other:.2f}; engine idle {last.get('time/engine_idle_s', 0.0) / wall:.2f}")


def main() -> None:
    args = parse_args(_parser(), dict(shape="tiny", steps=1, batch_size=1, group_size=2, max_response_tokens=32,
                                      vocab_ranks=SMOKE_VOCAB_RANKS))
    report(args, run(args))


if __name__ == "__main__":
    main()
