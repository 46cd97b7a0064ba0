"""Evidence that it learns: eval EM of a random-init model, of its SFT warm start, and after GRPO on top.

See docs/benchmarks.md#learning."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import SHAPES, SMOKE_VOCAB_RANKS, add_vocab_ranks_argument, parse_args, vocab_suffix  # noqa: E402
from bench.common.table import print_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# --task multihop: the prompt limit (the short prompt with a 4-hop question is ~45 Qwen tokens, a 3-hop one ~69 of
# SmolLM2's with its system turn; rollout.manage_context_at must lie above it) and the default response budget over
# every segment (a fold adds its instruction and summary; --max-response-tokens: a 5-hop chain's searches alone are
# ~400 of SmolLM2's tokens)
MULTIHOP_PROMPT_TOKENS = {"random": 96, "smollm2": 128}
MULTIHOP_RESPONSE_TOKENS = 512
# --model smollm2: GRPO checkpoints every this many steps (a stopped bench resumes from the newest), keeping one
GRPO_SAVE_INTERVAL = 5
# SFT checkpoints this many times a run (every 1/4 of its steps; the newest kept), from which a stopped bench resumes
SFT_CHECKPOINTS = 4


@dataclass(frozen=True)
class StartingModel:
    """What --model starts the pipeline from: its stage before any training, and the configs SFT and GRPO run."""

    first_stage: str  # the eval of the model as it is: a random-init model, or a pretrained one prompted
    sft_config: str
    grpo_config: str


MODELS = {
    "random": StartingModel("random", "examples/configs/sft_tiny.yaml", "examples/configs/search_grpo_tiny.yaml"),
    "smollm2": StartingModel("prompted", "examples/configs/sft_smollm2.yaml",
                             "examples/configs/search_grpo_smollm2.yaml"),
}
SMOLLM2_DIR = REPO / "outputs" / "assets" / "smollm2-135m-instruct"  # `rlsearch make-real-model` builds it once
# how the evals run (not what they score: a trajectory's seeds are its question's and sample's). A decode step of
# SmolLM2 on a CPU reads its 0.5 GB of weights whatever the batch, so 128 trajectories a batch (~1 GiB of KV cache)
# and not eval_search.yaml's 32
MODEL_EVAL_SETTINGS = {"random": (), "smollm2": ("eval.batch_size=128", "rollout.kv_cache_gib=1.0")}
# --task multihop's trajectories are 2-3x a 1-hop one's (a 3-hop trajectory of SmolLM2 is ~360 tokens): 128 of them
# at once take ~2 GiB of float32 KV cache
MULTIHOP_EVAL_SETTINGS = {"random": (), "smollm2": ("rollout.kv_cache_gib=2.0",)}


def _rlsearch(log: Path, *arguments: str) -> None:
    """Run `python -m rlsearch ARGS`, output appended to `log` (a resumed stage's too); a failure stops the bench
    naming the log. The line it prints gives the wall time, the CPU-seconds of the command and every process under it
    (Ray's, vLLM's, the tool servers': what the stage costs whatever else runs) and the load average at the end."""
    started = time.perf_counter()
    with log.open("a") as out:
        command = subprocess.Popen([PYTHON, "-m", "rlsearch", *arguments], cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT)
        cpu_s = _cpu_seconds_until_exit(command)
    if command.returncode:
        raise SystemExit(f"rlsearch {arguments[0]} failed (exit {command.returncode}): see {log}")
    print(f"  {arguments[0]:<14} {time.perf_counter() - started:6.0f} s  {cpu_s:6.0f} CPU-s  "
          f"load {os.getloadavg()[0]:4.1f}   {log}", flush=True)


def _cpu_seconds_until_exit(command: subprocess.Popen, every_s: float = 1.0) -> float:
    """Wait for `command`; the CPU time of it and its descendants, each process's as last sampled (every `every_s`:
    a process's last second is missed, and Ray's processes outlive no waiting parent to count them otherwise)."""
    import psutil

    last: dict[tuple[int, float], float] = {}
    root = psutil.Process(command.pid)
    while command.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for process in tree:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    last[(process.pid, process.create_time())] = times.user + times.system
            except psutil.Error:
                pass
        time.sleep(every_s)
    return sum(last.values())


def _em(summary: Path) -> float:
    return json.loads(summary.read_text())["metrics"]["overall"]["em"]


def _unsearched_share(eval_dir: Path) -> float:
    """The share of an eval's answers given without any search (tool call) before them."""
    with (eval_dir / "trajectories.jsonl").open() as rows:
        answers = [not any(turn["tool_calls"] for turn in row["turns"])
                   for row in map(json.loads, rows) if row["scores"]["has_answer"]]
    return statistics.fmean(answers) if answers else float("nan")


def _hop_ems(summary: Path) -> dict[int, float]:
    """EM per hop count from an eval summary's by_hops (the multihop test rows)."""
    from rlsearch.data.multihop import DATA_SOURCE

    per_hops = json.loads(summary.read_text()).get("by_hops", {}).get(DATA_SOURCE, {})
    return {int(hops): values["em"] for hops, values in per_hops.items()}


def _folded_share(eval_dir: Path) -> float:
    """The share of an eval's trajectories that folded their context at least once (a turn of kind summary)."""
    with (eval_dir / "trajectories.jsonl").open() as rows:
        folded = [any(turn["kind"] == "summary" for turn in json.loads(line)["turns"]) for line in rows]
    return statistics.fmean(folded) if folded else 0.0


def _common(data: Path, args: argparse.Namespace) -> list[str]:
    """Overrides shared by evals and training: the learnable toy task, no prefill or bias, sampled evals."""
    return [
        f"rollout.max_turns={args.max_turns}", f"rollout.max_tokens_per_turn={args.max_tokens_per_turn}",
        "rollout.assistant_prefix=", "rollout.logit_bias={}",
        "rollout.temperature=1.0", f"tools.retriever.corpus={data / 'corpus.jsonl'}",
        f"tools.retriever.topk={args.topk}", f"tools.retriever.index_cache_dir={data / 'bm25_cache'}",
        f"eval.files=[{data / 'test.jsonl'}]", f"eval.n_samples={args.eval_samples}", "eval.max_examples=0",
        f"rollout.prompt_file={args.prompt_file}",
        *(_context(args) if args.task == "multihop" else []),
    ]


def _context(args: argparse.Namespace) -> list[str]:
    """--task multihop: rollout.context within a window small enough that fold folds (see the module docstring)."""
    return [
        f"rollout.context={args.context}", f"rollout.context_window={args.context_window}",
        f"rollout.manage_context_at={args.manage_context_at}", f"rollout.summary_tokens={args.summary_tokens}",
        f"rollout.max_prompt_tokens={MULTIHOP_PROMPT_TOKENS[args.model]}",
        f"rollout.max_response_tokens={args.max_response_tokens}",
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
    _rlsearch(out.parent / f"{out.name}.log", "eval", "--config", "examples/configs/eval_search.yaml",
              f"model.path={model}", f"output_dir={out}", *_common(data, args), *MODEL_EVAL_SETTINGS[args.model],
              *(MULTIHOP_EVAL_SETTINGS[args.model] if args.task == "multihop" else ()))
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


def _grpo_arguments(model: Path, data: Path, out: Path, seed: int, args: argparse.Namespace,
                    *run_settings: str) -> list[str]:
    """`rlsearch train` from `model` on the seed's train questions with the bench's GRPO settings, `run_settings`
    (how it checkpoints and evaluates), then the --grpo-override ones."""
    return ["train", "--config", MODELS[args.model].grpo_config, f"model.path={model}", f"trainer.output_dir={out}",
            f"trainer.total_steps={args.grpo_steps}", f"trainer.seed={seed}", *run_settings,
            f"data.train_files=[{data / 'train.jsonl'}]", f"data.batch_size={args.batch_size}",
            f"rollout.group_size={args.group_size}", f"actor.lr={args.grpo_lr}",
            # a fine-tuned model's sharper distributions put fp32 engine-vs-actor logprob gaps near 1e-4 (1.05e-4
            # measured), the tiny config's limit for a random model; a broken sync is off by far more than 1e-3
            "weights.max_logprob_mismatch=1e-3", *_common(data, args), *args.grpo_override]


def _grpo(model: Path, data: Path, out: Path, seed: int, args: argparse.Namespace, *extra: str) -> float:
    """Train from `model` and return the held-out EM after the last step; a finished run's score is reused."""
    summary = _final_eval(out, args) / "summary.json"
    if (reused := _reused_em(summary, "train")) is not None:
        return reused
    shutil.rmtree(out, ignore_errors=True)  # an unfinished run's: trainer.resume=none refuses another run's dir
    _rlsearch(out.parent / f"{out.name}.log", *_grpo_arguments(
        model, data, out, seed, args, f"trainer.eval_interval={args.grpo_steps}", "trainer.resume=none",
        f"trainer.log_trajectories={str(args.task == 'multihop').lower()}"), *extra)
    return _em(summary)


def _grpo_resumable(model: Path, data: Path, out: Path, seed: int, args: argparse.Namespace) -> Path:
    """--model smollm2, whose steps take a minute: train from `model` with a checkpoint every GRPO_SAVE_INTERVAL
    steps (a stopped run resumes from the newest), write the last one as an HF dir (`rlsearch convert`) and score it
    with `rlsearch eval` as the other stages are scored. Returns the eval's dir; finished parts are reused."""
    last = f"step_{args.grpo_steps:06d}"
    latest = out / "checkpoints" / "latest"
    if not (out / "hf" / "config.json").is_file():
        if not (latest.is_file() and latest.read_text().strip() == last):
            _rlsearch(out.parent / f"{out.name}.log", *_grpo_arguments(
                model, data, out, seed, args, "trainer.resume=auto", f"trainer.save_interval={GRPO_SAVE_INTERVAL}",
                "trainer.keep_checkpoints=1", "trainer.eval_interval=0", "trainer.log_trajectories=true"))
        partial = out / "hf.partial"  # a conversion stopped half-way leaves no hf dir to reuse
        if partial.exists():
            shutil.rmtree(partial)
        _rlsearch(out.parent / f"convert-{out.name}.log", "convert", "mcore-to-hf", "--ckpt",
                  str(out / "checkpoints" / last), "--out", str(partial))
        partial.rename(out / "hf")
    eval_dir = out.parent / f"eval-{out.name}"
    _evaluate(out / "hf", data, eval_dir, args)
    return eval_dir


def _make_data(data: Path, work: Path, seed: int, args: argparse.Namespace) -> None:
    """The seed's data and SFT demonstrations: the learnable toy task (--model random), the toy corpus as it is
    (--model smollm2: invented multi-word names, look-alike passages), or --task multihop."""
    shared = ["--out", str(data), "--seed", str(seed), "--test-fraction", "0.5",
              "--demo-corpora", str(args.demo_corpora), "--flawed-fraction", str(args.flawed_fraction),
              "--demo-topk", str(args.topk), "--prompt-file", args.prompt_file]
    if args.task == "multihop":
        task = ["--task", "multihop", "--hops", ",".join(map(str, args.hops)), "--num-chains", str(args.num_chains),
                "--fold-fraction", str(args.fold_fraction)]
        if args.model == "random":  # single-token names, no look-alike passages: a copy a tiny model can learn
            task += ["--learnable", "--distractors-per-entity", "0"]
    elif args.model == "random":
        task = ["--learnable", "--name-pool", str(args.name_pool), "--answer-pool", str(args.answer_pool),
                "--num-entities", str(args.num_entities), "--distractors-per-entity", "0"]
    else:
        task = ["--num-entities", str(args.num_entities)]
    _rlsearch(work / "make-toy-data.log", "make-toy-data", *shared, *task)


def _starting_model(work: Path, seed: int, args: argparse.Namespace) -> Path:
    """--model random: the seed's random-init Qwen2 of --shape; smollm2: the converted asset (built once)."""
    if args.model == "smollm2":
        if not (SMOLLM2_DIR / "gguf_conversion.json").is_file():
            _rlsearch(work / "make-real-model.log", "make-real-model", "--out", str(SMOLLM2_DIR))
        return SMOLLM2_DIR
    from rlsearch.data.tiny_model import TinyModelSpec, make_tiny_model

    model = work / "random-model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, TinyModelSpec(**{**SHAPES[args.shape], "tie_word_embeddings": True, "seed": seed,
                                                "vocab_ranks": args.vocab_ranks}))
    return model


def run_seed(seed: int, root: Path, args: argparse.Namespace) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """The seed's EMs (and gains) overall, and per hop count (--task multihop; empty for toy)."""
    work = root / f"seed_{seed}{vocab_suffix(args.vocab_ranks)}"  # the random model and all that derives from it
    work.mkdir(parents=True, exist_ok=True)
    # --fold-fraction: data and SFT model of their own (demonstrations that fold), and so the runs from them
    demos = f"-folds{args.fold_fraction:g}" if args.fold_fraction else ""
    data = work / f"{args.task}{demos}"
    # multihop: data, random model and SFT model are shared by the contexts; evals and GRPO runs are per context
    runs = f"-{args.context}{demos}" if args.task == "multihop" else ""
    grpo = work / f"grpo{runs}{f'-{args.grpo_name}' if args.grpo_name else ''}"  # --grpo-name: beside the others
    print(f"seed {seed}: {work}", flush=True)
    if not (data / "sft.jsonl").is_file():
        _make_data(data, work, seed, args)
    model = _starting_model(work, seed, args)
    first = MODELS[args.model].first_stage
    evals = {"sft": work / f"eval-sft{runs}"}
    ems = {first: float("nan")}  # --no-random-eval: the same eval as the SFT model's, of a model that never answers
    if args.random_eval:
        evals[first] = work / f"eval-{first}{runs}"
        ems[first] = _evaluate(model, data, evals[first], args)
    sft = work / f"sft{demos}"
    if not (sft / "hf" / "config.json").is_file():  # an SFT stopped half-way continues from its newest checkpoint
        _rlsearch(work / "sft.log", "sft", "--config", MODELS[args.model].sft_config, f"model.path={model}",
                  f"data.train_files=[{data / 'sft.jsonl'}]", f"data.max_steps={args.sft_steps}",
                  f"actor.lr={args.sft_lr}", f"output_dir={sft}", f"seed={seed}",
                  f"save_interval={max(1, args.sft_steps // SFT_CHECKPOINTS)}", "resume=auto")
    ems["sft"] = _evaluate(sft / "hf", data, evals["sft"], args)
    if args.model == "smollm2":
        evals["grpo"] = _grpo_resumable(sft / "hf", data, grpo, seed, args)
        ems["grpo"] = _em(evals["grpo"] / "summary.json")
    else:
        ems["grpo"] = _grpo(sft / "hf", data, grpo, seed, args)
        evals["grpo"] = _final_eval(grpo, args)
    if args.ablation:
        ems["grpo_unmasked"] = _grpo(sft / "hf", data, work / f"grpo-unmasked{runs}", seed, args,
                                     "algo.mask_observations=false")
        evals["grpo_unmasked"] = _final_eval(work / f"grpo-unmasked{runs}", args)
    print(f"seed {seed}: " + ", ".join(f"{key} EM {value:.3f}" for key, value in ems.items()), flush=True)
    ems["grpo-sft"] = ems["grpo"] - ems["sft"]  # paired: the GRPO run starts from this seed's SFT model
    ems["gain z"] = _gain_z(evals["sft"], evals["grpo"])
    if args.model == "smollm2":  # a pretrained model may answer from what it believes it knows
        ems.update({f"unsearched {stage}": _unsearched_share(evals[stage]) for stage in (first, "sft", "grpo")
                    if stage in evals})
    if args.task == "toy":
        return ems, {}
    if args.context == "fold":
        ems.update({f"{stage} folded": _folded_share(evals[stage]) for stage in ("sft", "grpo")})
    per_hop: dict[int, dict[str, float]] = {}
    for stage, eval_dir in evals.items():
        for hops, em in _hop_ems(eval_dir / "summary.json").items():
            per_hop.setdefault(hops, {})[stage] = em
    for hops, hop_ems in per_hop.items():
        hop_ems = per_hop[hops] = {first: float("nan"), **hop_ems}
        hop_ems["grpo-sft"] = hop_ems["grpo"] - hop_ems["sft"]
        print(f"seed {seed}, {hops} hops: " + ", ".join(f"{key} EM {value:.3f}" for key, value in hop_ems.items()),
              flush=True)
    return ems, per_hop


def _spread(values: list[float]) -> float:
    """The standard deviation over seeds: 0 for one seed, nan where a stage was not measured (statistics.stdev
    fails on nan)."""
    if any(value != value for value in values):
        return float("nan")
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _print_table(results: list[dict[str, float]]) -> dict[str, float]:
    """A row per seed, then the mean and the spread over seeds, then the paired gain's t; returns the means."""
    keys = list(results[0])
    means = {key: statistics.fmean(r[key] for r in results) for key in keys}
    spreads = {key: _spread([r[key] for r in results]) for key in keys}
    print()
    print_table([("seed", ">14"), *((key, f">{max(14, len(key))}.3f") for key in keys)], [
        *([seed, *(ems[key] for key in keys)] for seed, ems in enumerate(results, start=1)),
        ["mean", *(means[key] for key in keys)], ["std", *(spreads[key] for key in keys)],
    ], rule=False)
    if len(results) > 1 and spreads["grpo-sft"]:
        t = means["grpo-sft"] / (spreads["grpo-sft"] / len(results) ** 0.5)
        print(f"paired gain over seeds: t = {t:.2f} ({len(results) - 1} degrees of freedom)", end="")
        print("; gain z: within a seed, over its test questions" if "gain z" in keys else "")
    return means


# options whose default depends on --model (None: not given): the random-init model's, the evidence above
RANDOM_MODEL_OPTIONS = dict(
    seeds=3, shape="tiny-4l", demo_corpora=150, prompt_file="examples/prompts/search_r1_short.yaml", topk=1,
    max_tokens_per_turn=48, sft_steps=3000, sft_lr=3e-3, grpo_steps=30, grpo_lr=1e-3, batch_size=8, group_size=8,
    eval_samples=4, ablation=True)
# --model smollm2 only: the toy corpus as it is (the random model's learnable names are not asked of it)
RANDOM_MODEL_ONLY = ("shape", "name_pool", "answer_pool")


def _smollm2_options() -> dict:
    """--model smollm2's defaults: its configs' prompt, turns, warm start and GRPO settings (what
    `RLSEARCH_CONFIG=examples/configs/search_grpo_smollm2.yaml bash examples/run_search_grpo.sh` trains), on toy data
    of 500 questions (250 held out), one seed, greedy evals, no ablation."""
    from rlsearch.config import SFTConfig, TrainConfig, load_config

    grpo = load_config(TrainConfig, REPO / MODELS["smollm2"].grpo_config)
    sft = load_config(SFTConfig, REPO / MODELS["smollm2"].sft_config)
    return dict(
        seeds=1, demo_corpora=0, prompt_file=grpo.rollout.prompt_file,
        topk=grpo.tools.retriever.topk,
        max_tokens_per_turn=grpo.rollout.max_tokens_per_turn, sft_steps=sft.data.max_steps, sft_lr=sft.actor.lr,
        grpo_steps=grpo.trainer.total_steps, grpo_lr=grpo.actor.lr, batch_size=grpo.data.batch_size,
        group_size=grpo.rollout.group_size, eval_samples=grpo.eval.n_samples, ablation=False)


def _model_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the options --model decides; an option of the random-init model's task is an error with smollm2."""
    if args.model == "smollm2":
        given = [f"--{name.replace('_', '-')}" for name in RANDOM_MODEL_ONLY if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)}: options of --model random only (smollm2 answers on the toy corpus "
                         "as it is)")
    for name, default in (RANDOM_MODEL_OPTIONS if args.model == "random" else _smollm2_options()).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


# options of one task only, with their defaults there (None: not given)
TOY_OPTIONS = {"name_pool": 1000, "answer_pool": 0, "num_entities": 330}
MULTIHOP_OPTIONS = {"hops": "3,4", "num_chains": 330, "context": "append", "context_window": 256,
                    "manage_context_at": 140, "summary_tokens": 32, "fold_fraction": 0.0}
# --model smollm2: 250 held-out questions of the toy corpus as it is; multihop: 2 and 3 hops, 200 held out, one look-
# alike passage per chain entity. With the short prompt a trajectory starts at ~65 of SmolLM2's tokens and a hop adds
# ~80 (a 3-hop one ends at ~310-335): append gets a roomy 1,024-token window; fold a 320-token one that a 3-hop
# trajectory overflows, folding at 200 tokens (after the second search: 206-241 tokens) into a summary of at most 64
# (the three facts of a 3-hop chain are ~43), with a turn more (the summary is a turn). Fold's warm start folds half
# of its good demonstrations (--fold-fraction): without it the model, asked to summarise, writes turns instead
SMOLLM2_TASK_OPTIONS = {"toy": {"num_entities": 500, "max_turns": 3},
                        "multihop": {"hops": "2,3", "num_chains": 400}}
SMOLLM2_CONTEXT_OPTIONS = {"append": {"context_window": 1024, "manage_context_at": 768},
                           "fold": {"context_window": 320, "manage_context_at": 200, "summary_tokens": 64,
                                    "fold_fraction": 0.5}}


def _task_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the options of --task with their defaults (after --model's); an option of the other task is an
    error."""
    own, other = (TOY_OPTIONS, MULTIHOP_OPTIONS) if args.task == "toy" else (MULTIHOP_OPTIONS, TOY_OPTIONS)
    given = [f"--{name.replace('_', '-')}" for name in other if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)}: not an option of --task {args.task}")
    if args.model == "smollm2":
        own = {**own, **SMOLLM2_TASK_OPTIONS[args.task]}
        if args.task == "multihop":
            own = {**own, **SMOLLM2_CONTEXT_OPTIONS[args.context or own["context"]]}
    for name, default in own.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.task == "toy":
        args.max_turns = 3 if args.max_turns is None else args.max_turns
        args.out = args.out or f"outputs/bench/learning{'-smollm2' if args.model == 'smollm2' else ''}"
        return args
    from rlsearch.data.multihop import parse_hops

    try:
        args.hops = parse_hops(args.hops)
    except ValueError as err:
        parser.error(f"--hops: {err}")
    if not args.hops:
        parser.error("--hops: give at least one hop count")
    if args.max_turns is None:  # k searches, then the answer; smollm2's fold: and a summary turn
        args.max_turns = max(args.hops) + 1 + (args.model == "smollm2" and args.context == "fold")
    args.out = args.out or f"outputs/bench/learning{'-smollm2' if args.model == 'smollm2' else ''}-multihop"
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("toy", "multihop"), default="toy",
                        help="toy: one search per question (default); multihop: chains of --hops searches")
    parser.add_argument("--model", choices=sorted(MODELS), default="random",
                        help="random: a random-init Qwen2 of --shape on the learnable toy task (default); smollm2: "
                        "SmolLM2-135M-Instruct (`rlsearch make-real-model`) on the toy corpus, prompted, then its "
                        "SFT warm start and GRPO as examples/configs/*_smollm2.yaml set them")
    parser.add_argument("--seeds", type=int, default=None, help="default: random 3, smollm2 1")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random: its shape (default tiny-4l)")
    parser.add_argument("--name-pool", type=int, default=None,
                        help="toy: single-token names the data draws from (default 1000)")
    parser.add_argument("--answer-pool", type=int, default=None,
                        help="toy: deal every answer from this many other fixed names (default 0: answers come from "
                        "--name-pool)")
    parser.add_argument("--num-entities", type=int, default=None,
                        help="toy: questions (half train, half test; default random 330, smollm2 500); each takes 3 "
                        "names of the pool (1 with --answer-pool)")
    parser.add_argument("--hops", default=None, metavar="K,K,...",
                        help="multihop: the questions' hop counts, spread evenly (default 3,4; smollm2 2,3)")
    parser.add_argument("--num-chains", type=int, default=None,
                        help="multihop: questions, one per chain (half train, half test; default 330, smollm2 400)")
    parser.add_argument("--context", choices=("append", "fold"), default=None,
                        help="multihop: rollout.context of every eval and GRPO run (default append)")
    parser.add_argument("--context-window", type=int, default=None,
                        help="multihop: rollout.context_window in tokens (default 256: holds a whole 4-hop trajectory)")
    parser.add_argument("--manage-context-at", type=int, default=None,
                        help=f"multihop: rollout.manage_context_at in tokens, above {MULTIHOP_PROMPT_TOKENS} (default "
                        "140: fold summarises after the third hop)")
    parser.add_argument("--summary-tokens", type=int, default=None,
                        help="multihop: rollout.summary_tokens, the most tokens of a fold's summary (default 32)")
    parser.add_argument("--fold-fraction", type=float, default=None,
                        help="multihop: share of the good SFT demonstrations that fold (make-toy-data "
                        "--fold-fraction); above 0 the data, the SFT model and the runs get dirs of their own, "
                        "suffixed -foldsF (default 0; smollm2 with --context fold 0.5)")
    # the defaults of these depend on --model: RANDOM_MODEL_OPTIONS, or smollm2's configs (_smollm2_options)
    parser.add_argument("--demo-corpora", type=int, default=None, help="more corpora whose demonstrations SFT sees")
    parser.add_argument("--prompt-file", default=None)
    parser.add_argument("--flawed-fraction", type=float, default=0.5)
    parser.add_argument("--topk", type=int, default=None, help="passages per search (demonstrations and rollouts)")
    parser.add_argument("--max-turns", type=int, default=None,
                        help="rollout.max_turns (default: toy 3, smollm2 its config's; multihop k + 1 for the "
                        "largest k, and k + 2 for smollm2 with --context fold: its summary is a turn)")
    parser.add_argument("--max-tokens-per-turn", type=int, default=None, help="rollout.max_tokens_per_turn")
    parser.add_argument("--max-response-tokens", type=int, default=MULTIHOP_RESPONSE_TOKENS,
                        help="--task multihop: rollout.max_response_tokens, over every segment of a trajectory")
    parser.add_argument("--sft-steps", type=int, default=None)
    parser.add_argument("--sft-lr", type=float, default=None)
    parser.add_argument("--grpo-steps", type=int, default=None)
    parser.add_argument("--grpo-lr", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per GRPO step")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="samples per test question (mean@k is the EM; default random 4, smollm2 its config's)")
    parser.add_argument("--grpo-override", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra override of the GRPO runs, e.g. algo.num_minibatches=2 (repeatable)")
    parser.add_argument("--grpo-name", default="", metavar="NAME",
                        help="the GRPO run's dir is grpo[-CONTEXT]-NAME: a run with other --grpo-override settings "
                        "beside the default one, from the same SFT model and paired with the same SFT eval")
    parser.add_argument("--no-ablation", dest="ablation", action="store_false", default=None,
                        help="skip the GRPO run without observation masking (smollm2 never runs it)")
    parser.add_argument("--no-random-eval", dest="random_eval", action="store_false",
                        help="skip the eval of the model as it is (random-init, or smollm2 prompted; its EM shows "
                        "nan)")
    parser.add_argument("--out", default=None,
                        help="default outputs/bench/learning (toy), outputs/bench/learning-multihop (multihop, both "
                        "contexts)")
    add_vocab_ranks_argument(parser)
    return parser


def main() -> None:
    parser = _parser()
    args = _task_defaults(parser, _model_defaults(parser, parse_args(parser, dict(
        seeds=1, demo_corpora=2, sft_steps=2, grpo_steps=1, batch_size=2, group_size=2, eval_samples=1,
        ablation=False, random_eval=False, vocab_ranks=SMOKE_VOCAB_RANKS))))
    if args.smoke:  # 4 test questions
        setattr(args, "num_entities" if args.task == "toy" else "num_chains", 8)

    root = Path(args.out).resolve()
    seeds = [run_seed(seed, root, args) for seed in range(1, args.seeds + 1)]
    if args.task == "multihop":
        print(f"\nmultihop, hops {','.join(map(str, args.hops))}, rollout.context={args.context}: overall")
    means = _print_table([ems for ems, _ in seeds])
    first = MODELS[args.model].first_stage
    print(f"EM {first} {means[first]:.3f}, SFT {means['sft']:.3f}, GRPO {means['grpo']:.3f}")
    if args.model == "smollm2":
        print("answers without a search: " + ", ".join(
            f"{stage} {means[key]:.3f}" for stage in (first, "sft", "grpo") if (key := f"unsearched {stage}") in means))
    for hops in seeds[0][1]:
        print(f"\n{hops} hops")
        hop_means = _print_table([per_hop[hops] for _, per_hop in seeds])
        print(f"{hops} hops: EM {first} {hop_means[first]:.3f}, SFT {hop_means['sft']:.3f}, "
              f"GRPO {hop_means['grpo']:.3f}")


if __name__ == "__main__":
    main()
