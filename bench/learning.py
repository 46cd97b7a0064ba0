"""Evidence that it learns: eval EM of a random-init model, of its SFT warm start, and after GRPO on top of it.

Per seed, through the real entry points (each a subprocess, as a user runs them):
  data   : `rlsearch make-toy-data --learnable --name-pool N --demo-corpora K --flawed-fraction F` (single-token
           names from a fixed pool of N words, no year questions, no distractor passages, half of the questions in
           test.jsonl; sft.jsonl holds the demonstrations of the train questions and of K more corpora with other
           seeds, a fraction F of them answering wrongly), all with the short prompt --prompt-file
  model  : a random-init Qwen2 of --shape (tied embeddings: with tied input/output embeddings copying a token is
           the identity, which the task is made of)
Why so: the task is two copies (the entity from the question into the query, the answer from the passage into the
answer). A tiny model trained on one corpus's few hundred demonstrations memorises them; on thousands of
demonstrations over ~9,000 rare names it learns the copy too slowly for a CPU. On demonstrations pooled from many
corpora over 1,000 names it cannot memorise (each corpus gives every name other facts) and sees every name often:
the answer copy appears within 3,000 steps, and 165 train questions (each seen ~1.5 times in 30 GRPO steps) keep
GRPO from memorising the train set instead of improving the copy.
  random : `rlsearch eval` of the random model
  sft    : `rlsearch sft` on the demonstrations (--sft-steps), then `rlsearch eval` of output_dir/hf
  grpo   : `rlsearch train` from the SFT model (--grpo-steps), scored on the test set after its last step through
           the same eval code path (trainer.eval_interval)
  ablate : the same GRPO run with algo.mask_observations=false (tool output trained as if sampled)
Every eval samples at the rollout temperature (1.0) --eval-samples times per test question, so EM is the policy's
expected exact match (mean@k), not a greedy decode that would hide the flawed demonstrations' share. The table shows
every seed with its paired gain (GRPO EM - SFT EM) and that gain's z over the seed's test questions (the mean of the
per-question gains over their standard error: the eval's sampling noise), then the mean and spread (sample standard
deviation) over seeds and the gain's paired t over seeds (seed noise); the last line prints the three EMs in the
order random, SFT, GRPO (means over seeds).

  .venv/bin/python bench/learning.py                                   # 3 seeds (outside CI: ~45 min a seed on 2 cores)
  .venv/bin/python bench/learning.py --seeds 1 --sft-steps 5 --grpo-steps 2 --num-entities 100   # mechanics only
  .venv/bin/python bench/learning.py --seeds 1 --grpo-override algo.num_minibatches=2 --out outputs/bench/learning-mb2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SHAPES  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _rlsearch(log: Path, *arguments: str) -> None:
    """Run `python -m rlsearch ARGS`, output to `log`; a failure stops the bench naming the log."""
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.call([PYTHON, "-m", "rlsearch", *arguments], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"rlsearch {arguments[0]} failed (exit {code}): see {log}")
    print(f"  {arguments[0]:<14} {time.perf_counter() - started:6.0f} s   {log}", flush=True)


def _em(summary: Path) -> float:
    return json.loads(summary.read_text())["metrics"]["overall"]["em"]


def _common(data: Path, args: argparse.Namespace) -> list[str]:
    """Overrides shared by evals and training: the learnable toy task, no prefill or bias, sampled evals."""
    return [
        f"rollout.max_turns={args.max_turns}", "rollout.assistant_prefix=", "rollout.logit_bias={}",
        "rollout.temperature=1.0", f"tools.retriever.corpus={data / 'corpus.jsonl'}",
        f"tools.retriever.topk={args.topk}", f"tools.retriever.index_cache_dir={data / 'bm25_cache'}",
        f"eval.files=[{data / 'test.jsonl'}]", f"eval.n_samples={args.eval_samples}", "eval.max_examples=0",
        f"rollout.prompt_file={args.prompt_file}",
    ]


def _reused_em(summary: Path, step: str) -> float | None:
    """The EM of a finished step found on disk, or None when it has to run."""
    if not summary.is_file():
        return None
    print(f"  {step:<14} reused {summary}", flush=True)
    return _em(summary)


def _evaluate(model: Path, data: Path, out: Path, args: argparse.Namespace) -> float:
    """Score `model` on the test set; a finished eval's score is reused."""
    if (reused := _reused_em(out / "summary.json", "eval")) is not None:
        return reused
    _rlsearch(out.with_suffix(".log"), "eval", "--config", "examples/configs/eval_search.yaml",
              f"model.path={model}", f"output_dir={out}", *_common(data, args))
    return _em(out / "summary.json")


def _final_eval(run: Path, args: argparse.Namespace) -> Path:
    return run / "eval" / f"step_{args.grpo_steps:06d}"


def _question_ems(eval_dir: Path) -> dict[str, float]:
    """Each test question's EM averaged over its samples, from an eval's trajectories."""
    samples: dict[str, list[float]] = {}
    with (eval_dir / "trajectories.jsonl").open() as rows:
        for line in rows:
            row = json.loads(line)
            samples.setdefault(row["example_id"], []).append(row["scores"]["em"])
    return {question: statistics.fmean(ems) for question, ems in samples.items()}


def _gain_z(sft_eval: Path, grpo_eval: Path) -> float:
    """A seed's paired gain over its test questions in units of its standard error (the eval's sampling noise)."""
    sft, grpo = _question_ems(sft_eval), _question_ems(grpo_eval)
    gains = [grpo[question] - sft[question] for question in sft]
    spread = statistics.stdev(gains)
    return statistics.fmean(gains) / (spread / len(gains) ** 0.5) if spread else 0.0


def _grpo(model: Path, data: Path, out: Path, seed: int, args: argparse.Namespace, *extra: str) -> float:
    """Train from `model` and return the held-out EM after the last step; a finished run's score is reused."""
    summary = _final_eval(out, args) / "summary.json"
    if (reused := _reused_em(summary, "train")) is not None:
        return reused
    _rlsearch(out.with_suffix(".log"), "train", "--config", "examples/configs/search_grpo_tiny.yaml",
              f"model.path={model}", f"trainer.output_dir={out}", f"trainer.total_steps={args.grpo_steps}",
              f"trainer.eval_interval={args.grpo_steps}", f"trainer.seed={seed}", "trainer.resume=none",
              f"data.train_files=[{data / 'train.jsonl'}]", f"data.batch_size={args.batch_size}",
              f"rollout.group_size={args.group_size}", f"actor.lr={args.grpo_lr}", "trainer.log_trajectories=false",
              # a fine-tuned model's sharper distributions put fp32 engine-vs-actor logprob gaps near 1e-4 (1.05e-4
              # measured), the tiny config's limit for a random model; a broken sync is off by far more than 1e-3
              "bridge.max_logprob_mismatch=1e-3", *_common(data, args), *args.grpo_override, *extra)
    return _em(summary)


def run_seed(seed: int, root: Path, args: argparse.Namespace) -> dict[str, float]:
    from rlsearch.data.tiny_model import TinyModelSpec, make_tiny_model

    work = root / f"seed_{seed}"
    work.mkdir(parents=True, exist_ok=True)
    data = work / "toy"
    print(f"seed {seed}: {work}", flush=True)
    if not (data / "sft.jsonl").is_file():
        _rlsearch(work / "make-toy-data.log", "make-toy-data", "--out", str(data), "--seed", str(seed),
                  "--learnable", "--name-pool", str(args.name_pool), "--answer-pool", str(args.answer_pool),
                  "--num-entities", str(args.num_entities),
                  "--distractors-per-entity", "0", "--test-fraction", "0.5", "--demo-corpora", str(args.demo_corpora),
                  "--flawed-fraction", str(args.flawed_fraction), "--demo-topk", str(args.topk),
                  "--prompt-file", args.prompt_file)
    model = work / "random-model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, TinyModelSpec(**{**SHAPES[args.shape], "tie_word_embeddings": True, "seed": seed}))
    ems = {"random": _evaluate(model, data, work / "eval-random", args)}
    sft = work / "sft"
    if not (sft / "hf" / "config.json").is_file():
        _rlsearch(work / "sft.log", "sft", "--config", "examples/configs/sft_tiny.yaml", f"model.path={model}",
                  f"data.train_files=[{data / 'sft.jsonl'}]", f"data.max_steps={args.sft_steps}",
                  f"actor.lr={args.sft_lr}", f"output_dir={sft}", f"seed={seed}")
    ems["sft"] = _evaluate(sft / "hf", data, work / "eval-sft", args)
    ems["grpo"] = _grpo(sft / "hf", data, work / "grpo", seed, args)
    if args.ablation:
        ems["grpo_unmasked"] = _grpo(sft / "hf", data, work / "grpo-unmasked", seed, args,
                                     "algo.mask_observations=false")
    print(f"seed {seed}: " + ", ".join(f"{key} EM {value:.3f}" for key, value in ems.items()), flush=True)
    ems["grpo-sft"] = ems["grpo"] - ems["sft"]  # paired: the GRPO run starts from this seed's SFT model
    ems["gain z"] = _gain_z(work / "eval-sft", _final_eval(work / "grpo", args))
    return ems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny-4l")
    parser.add_argument("--name-pool", type=int, default=1000, help="single-token names the toy data draws from")
    parser.add_argument("--answer-pool", type=int, default=0,
                        help="deal every answer from this many other fixed names (0: answers come from --name-pool)")
    parser.add_argument("--num-entities", type=int, default=330,
                        help="toy questions (half train, half test); each takes 3 names of the pool "
                        "(1 with --answer-pool)")
    parser.add_argument("--demo-corpora", type=int, default=150, help="more corpora whose demonstrations SFT sees")
    parser.add_argument("--prompt-file", default="examples/prompts/search_r1_short.yaml")
    parser.add_argument("--flawed-fraction", type=float, default=0.5)
    parser.add_argument("--topk", type=int, default=1, help="passages per search (demonstrations and rollouts)")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--sft-steps", type=int, default=3000)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--grpo-lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per GRPO step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per test question (mean@k is the EM)")
    parser.add_argument("--grpo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra override of the GRPO runs, e.g. algo.num_minibatches=2 (repeatable)")
    parser.add_argument("--no-ablation", dest="ablation", action="store_false",
                        help="skip the GRPO run without observation masking")
    parser.add_argument("--out", default="outputs/bench/learning")
    args = parser.parse_args()

    root = Path(args.out).resolve()
    results = [run_seed(seed, root, args) for seed in range(1, args.seeds + 1)]
    keys = list(results[0])
    print("\n" + " ".join(f"{key:>14}" for key in ["seed", *keys]))
    for seed, ems in enumerate(results, start=1):
        print(" ".join([f"{seed:>14}", *(f"{ems[key]:>14.3f}" for key in keys)]))
    means = {key: statistics.fmean(r[key] for r in results) for key in keys}
    spreads = {key: statistics.stdev(r[key] for r in results) if len(results) > 1 else 0.0 for key in keys}
    print(" ".join([f"{'mean':>14}", *(f"{means[key]:>14.3f}" for key in keys)]))
    print(" ".join([f"{'std':>14}", *(f"{spreads[key]:>14.3f}" for key in keys)]))
    if len(results) > 1 and spreads["grpo-sft"]:
        t = means["grpo-sft"] / (spreads["grpo-sft"] / len(results) ** 0.5)
        print(f"paired gain over seeds: t = {t:.2f} ({len(results) - 1} degrees of freedom); gain z: within a seed, "
              "over its test questions")
    print(f"EM random {means['random']:.3f}, SFT {means['sft']:.3f}, GRPO {means['grpo']:.3f}")


if __name__ == "__main__":
    main()
