"""PPO with a learned critic against GRPO: the actor's and the critic's work of one training step, same model and
samples, measured in one run.

See docs/benchmarks.md#ppo_step."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import SMOKE_VOCAB_RANKS, TINY, count_params, parse_args, random_tokens  # noqa: E402
from bench.common.memory import memory_mib, pickle_by_value_for_ray, reset_peak_memory  # noqa: E402
from bench.common.table import header_lines, row_line  # noqa: E402
from bench.train_step import (  # noqa: E402
    CLIP_GRAD,
    LR,
    TEMPERATURE,
    add_model_arguments,
    build_model,
    describe_model,
    response_mask,
    uses_gpu,
)
from rlsearch.devices import cpu_cores  # noqa: E402
from rlsearch.trajectory import Trajectory  # noqa: E402

if TYPE_CHECKING:
    from rlsearch.actor import ActorRanks, CriticRanks
    from rlsearch.config import AlgoConfig, CriticConfig

CRITIC_LR = 10 * LR  # Search-R1's train_ppo.sh: critic 1e-5, actor 1e-6
VALUE_CLIP = 0.5  # verl's critic.cliprange_value, Search-R1's PPO
# a row per step: wall and CPU seconds, the PPO step's parts (critic values, GAE, critic updates, policy update, and
# the old-logprob pass inside the policy update), the policy loss and the value loss
COLUMNS = [("rep", ">7"), ("side", "<5"), ("step s", ">7.2f"), ("cpu s", ">6.2f"), ("values", ">7.2f"),
           ("gae", ">6.3f"), ("critic", ">7.2f"), ("policy", ">7.2f"), ("old lp", ">7.2f"), ("loss", ">8.4f"),
           ("value loss", ">10.4f")]


# ---- the batch ----------------------------------------------------------------------------------------------------

def make_trajectories(groups: int, group_size: int, min_len: int, max_len: int, seed: int, vocab_ranks: int = 0
                      ) -> list[Trajectory]:
    """Search-agent-like rollouts: `groups` GRPO groups of `group_size` trajectories sharing a prompt of 60-160
    tokens (fewer where `min_len` leaves under 40 for the response), each response alternating model turns (20-80
    tokens, sampled) and tool observations (60-160, masked), ending on a model turn; `min_len`-`max_len` tokens in
    all. Random token ids of the model's vocabulary (`vocab_ranks` as --vocab-ranks), rollout logprobs near a random
    model's with noise, rewards 0, 0.1 or 1 (wrong, well-formed, right: the toy task's)."""
    ids_below, random_logprob = random_tokens(vocab_ranks)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for group in range(groups):
        longest = min(160, min_len - 40)  # a response of 40 tokens or more
        prompt_len = rng.randint(min(60, longest), longest)
        prompt = torch.randint(0, ids_below, (prompt_len,), generator=generator).tolist()
        for index in range(group_size):
            mask = response_mask(rng, rng.randint(min_len, max_len) - prompt_len)
            logprobs = (random_logprob + 0.3 * torch.randn(len(mask), generator=generator)).tolist()
            trajectories.append(Trajectory(
                example_id=f"q{group}", group_id=group, sample_index=index, prompt_ids=prompt,
                response_ids=torch.randint(0, ids_below, (len(mask),), generator=generator).tolist(), loss_mask=mask,
                rollout_logprobs=[lp if m else 0.0 for lp, m in zip(logprobs, mask)],
                finish_reason="answer", reward=rng.choice((0.0, 0.1, 1.0)),
            ))
    return trajectories


# ---- the two steps ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Sides:
    """The actor ranks (both sides), the critic's beside them (PPO), and each side's algo and critic settings."""

    actor: ActorRanks
    critic: CriticRanks
    grpo: AlgoConfig
    ppo: AlgoConfig
    critic_settings: CriticConfig


def grpo_step(sides: Sides, trajectories: list[Trajectory]) -> tuple[dict[str, float], dict[str, float]]:
    """The actor's work of a GRPO step: old logprobs, then algo.num_minibatches updates. (seconds by phase, figures)"""
    from rlsearch.trainer.step_batch import train_samples
    from rlsearch.trainer.update import policy_update

    samples = train_samples(trajectories, sides.grpo)
    started = time.perf_counter()
    update = policy_update(sides.actor, samples, sides.grpo)
    seconds = {"policy": time.perf_counter() - started, "old lp": update.metrics["time/old_logprob_s"]}
    return seconds, {"loss": update.metrics["actor/policy_loss"]}


def ppo_step(sides: Sides, trajectories: list[Trajectory]) -> tuple[dict[str, float], dict[str, float]]:
    """The actor's and the critic's work of a PPO step on the same samples, as `GRPOTrainer.grpo_step` runs it: the
    critic's values, GAE (`token_estimates`), the critic's updates, the policy update. (seconds by phase, figures)"""
    from rlsearch.trainer.estimates import token_estimates
    from rlsearch.trainer.step_batch import train_samples
    from rlsearch.trainer.update import critic_update, policy_update

    samples = train_samples(trajectories, sides.ppo)
    seconds: dict[str, float] = {}

    def timed(phase: str, run: Callable):
        started = time.perf_counter()
        result = run()
        seconds[phase] = time.perf_counter() - started
        return result

    values = timed("values", lambda: sides.critic.compute_values(samples))
    timed("estimates", lambda: token_estimates(trajectories, samples, sides.ppo, values))
    critic_metrics = timed("critic", lambda: critic_update(sides.critic, samples, sides.ppo, sides.critic_settings))
    update = timed("policy", lambda: policy_update(sides.actor, samples, sides.ppo))
    seconds["old lp"] = update.metrics["time/old_logprob_s"]
    return seconds, {"loss": update.metrics["actor/policy_loss"], "value loss": critic_metrics["critic/value_loss"]}


def start_ranks(args: argparse.Namespace, model_path: Path, threads: int, on_gpu: bool) -> Sides:
    """The actor ranks (TP1PP1, one rank) and the critic's beside them, as the trainer places them: half a GPU each
    on a GPU; on CPU every thread each (the two never compute at once)."""
    from rlsearch.actor import ActorRanks, ActorWorkerSpec, CriticRanks, SamplingDistribution
    from rlsearch.config import ActorConfig, AlgoConfig, CriticConfig

    grpo = AlgoConfig(num_minibatches=args.minibatches)
    ppo = dataclasses.replace(grpo, advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=True)
    settings = CriticConfig(lr=CRITIC_LR, value_clip=VALUE_CLIP)
    actor = ActorConfig(num_threads=threads, lr=LR, clip_grad=CLIP_GRAD,
                        max_tokens_per_microbatch=args.max_tokens_per_microbatch)
    updates = (args.warmup + args.repetitions) * 2 * args.minibatches  # both sides step the one actor
    # the actor's spec carries GRPO's algo: its loss reads the policy-loss keys, which the two sides share
    spec = ActorWorkerSpec(str(model_path), args.dtype, actor, grpo, SamplingDistribution(TEMPERATURE), updates,
                           args.seed)
    gpus = 1 if on_gpu else 0
    print("starting the actor ranks and the critic's beside them ...", flush=True)
    actor_ranks = ActorRanks(spec, num_gpus_per_rank=gpus, gpu_share=0.5)
    critic_spec = dataclasses.replace(spec, value_model=True, actor=settings.ranks_config(actor))
    critic_ranks = CriticRanks(critic_spec, num_gpus_per_rank=gpus, gpu_share=0.5, beside=actor_ranks)
    return Sides(actor_ranks, critic_ranks, grpo, ppo, settings)


# ---- driver -------------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.set_defaults(hidden=TINY["hidden_size"], layers=TINY["num_layers"], heads=TINY["num_attention_heads"],
                        kv_heads=TINY["num_key_value_heads"], intermediate=TINY["intermediate_size"])  # the tiny shape
    batch = parser.add_argument_group("batch")
    batch.add_argument("--groups", type=int, default=2, help="GRPO groups (prompts) per step")
    batch.add_argument("--group-size", type=int, default=4, help="trajectories per group, sharing its prompt")
    batch.add_argument("--min-len", type=int, default=150, help="shortest trajectory (prompt + response tokens)")
    batch.add_argument("--max-len", type=int, default=600, help="longest trajectory")
    batch.add_argument("--seed", type=int, default=0)
    run = parser.add_argument_group("run")
    run.add_argument("--repetitions", type=int, default=3, help="timed steps per side")
    run.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    run.add_argument("--minibatches", type=int, default=2,
                     help="algo.num_minibatches of both sides: old logprobs, then this many updates (and as many "
                          "critic updates)")
    run.add_argument("--threads", type=int, default=0, help="torch threads of each rank; 0: RLSEARCH_CPU_CORES or all")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto: CUDA when available, else CPU")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--max-tokens-per-microbatch", type=int, default=4096,
                     help="actor.max_tokens_per_microbatch of the actor and the critic")
    run.add_argument("--out", default="outputs/bench", help="where the random model is cached")
    return parser


def describe_batch(trajectories: list[Trajectory], args: argparse.Namespace) -> int:
    """The batch's line; returns its tokens."""
    lengths = [len(t.token_ids) for t in trajectories]
    response = sum(len(t.response_ids) for t in trajectories)
    sampled = sum(sum(t.loss_mask) for t in trajectories)
    print(f"batch: {args.groups} groups x {args.group_size} trajectories sharing their group's prompt, "
          f"{min(lengths)}-{max(lengths)} tokens, {sum(lengths)} in all ({response} response, {sampled} sampled, "
          f"{response - sampled} in masked observations); rewards "
          f"{', '.join(f'{t.reward:g}' for t in trajectories)}", flush=True)
    return sum(lengths)


def timed_steps(args: argparse.Namespace, sides: Sides, trajectories: list[Trajectory]
                ) -> tuple[dict[str, list[dict[str, float]]], dict[str, dict[str, float]]]:
    """--warmup then --repetitions steps of each side, alternated (GRPO, PPO, PPO, GRPO, ...): (each side's timed
    seconds by phase per step, with "cpu", the CPU seconds of the two ranks' processes in the step; each side's peak
    memory per rank in MiB over its timed steps)."""
    import ray

    ranks = {"actor": sides.actor.workers[0], "critic": sides.critic.workers[0]}

    def cpu_seconds() -> float:  # user + system, every thread of both ranks
        return sum(ray.get([rank.__ray_call__.remote(lambda w: time.process_time()) for rank in ranks.values()]))

    steps = {"grpo": grpo_step, "ppo": ppo_step}
    seconds: dict[str, list[dict[str, float]]] = {side: [] for side in steps}
    peaks: dict[str, dict[str, float]] = {side: dict.fromkeys(ranks, 0.0) for side in steps}
    order = list(steps)
    print("\n".join(header_lines(COLUMNS)), flush=True)
    for repetition in range(args.warmup + args.repetitions):
        timed = repetition >= args.warmup
        for side in order:
            ray.get([rank.__ray_call__.remote(lambda w: reset_peak_memory()) for rank in ranks.values()])
            cpu, started = cpu_seconds(), time.perf_counter()
            phases, figures = steps[side](sides, trajectories)
            phases["step"] = time.perf_counter() - started
            phases["cpu"] = cpu_seconds() - cpu
            if timed:
                seconds[side].append(phases)
                for name, rank in ranks.items():
                    peak = ray.get(rank.__ray_call__.remote(lambda w: memory_mib()))[1]
                    peaks[side][name] = max(peaks[side][name], peak)
            label = f"{repetition + 1 - args.warmup}" if timed else "warm-up"
            print(row_line(COLUMNS, [label, side, phases["step"], phases["cpu"], phases.get("values", "-"),
                                     phases.get("estimates", "-"), phases.get("critic", "-"), phases["policy"],
                                     phases["old lp"], figures["loss"], figures.get("value loss", "-")]), flush=True)
        order.reverse()
    return seconds, peaks


def report(args: argparse.Namespace, on_gpu: bool, tokens: int, seconds: dict[str, list[dict[str, float]]],
           peaks: dict[str, dict[str, float]]) -> None:
    """Each side's fastest and median step, its phases (medians) and peak memory; the figure: PPO / GRPO of the
    fastest steps (on a shared machine the fastest of several is the one least slowed by a neighbour; the medians'
    ratio is printed beside it)."""
    unit = "CUDA allocated" if on_gpu else "RSS"
    best = {side: min(step["step"] for step in steps) for side, steps in seconds.items()}
    median = {side: {phase: statistics.median(step[phase] for step in steps) for phase in steps[0]}
              for side, steps in seconds.items()}
    grpo, ppo = median["grpo"], median["ppo"]
    n = args.repetitions
    print(f"grpo: {best['grpo']:.2f} s a step, fastest of {n} (median {grpo['step']:.2f} s: old logprobs "
          f"{grpo['old lp']:.2f} s, then {args.minibatches} updates {grpo['policy'] - grpo['old lp']:.2f} s), "
          f"{tokens / best['grpo']:.0f} tokens/s; peak {unit} of the actor rank {peaks['grpo']['actor']:.0f} MiB")
    print(f"ppo : {best['ppo']:.2f} s a step, fastest of {n} (median {ppo['step']:.2f} s: critic values "
          f"{ppo['values']:.2f} s, gae {ppo['estimates']:.3f} s, {args.minibatches} critic updates {ppo['critic']:.2f} "
          f"s, policy update {ppo['policy']:.2f} s), {tokens / best['ppo']:.0f} tokens/s; peak {unit} of the actor "
          f"rank {peaks['ppo']['actor']:.0f} MiB, of the critic rank {peaks['ppo']['critic']:.0f} MiB")
    critic = ppo["values"] + ppo["critic"]
    print(f"the critic's work (medians) {critic:.2f} s = {critic / grpo['policy']:.2f}x the actor's in a GRPO step; "
          f"medians' ratio PPO / GRPO {ppo['step'] / grpo['step']:.2f}x")
    print(f"load average at the end: {' '.join(f'{load:.1f}' for load in os.getloadavg())} (1, 5, 15 min)")
    cpu = {side: min(step["cpu"] for step in steps) for side, steps in seconds.items()}
    # the work itself, which a neighbour's load moves far less than the wall time (the smoke test's check)
    print(f"PPO / GRPO CPU seconds of the ranks (least of each side): {cpu['ppo']:.2f} / {cpu['grpo']:.2f} s = "
          f"{cpu['ppo'] / cpu['grpo'] if cpu['grpo'] > 0 else math.inf:.2f}x")
    ratio = best["ppo"] / best["grpo"] if best["grpo"] > 0 else math.inf
    print(f"PPO / GRPO step time (actor + critic against actor, same samples, fastest steps; goal <= 1.6): "
          f"{ratio:.2f}x")


def main() -> None:
    parser = _parser()
    args = parse_args(parser, dict(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, groups=1,
                                   group_size=2, min_len=150, max_len=250, repetitions=5, warmup=1, threads=1,
                                   vocab_ranks=SMOKE_VOCAB_RANKS))
    on_gpu = uses_gpu(parser, args)
    threads = args.threads or cpu_cores()

    from rlsearch.trainer import init_ray

    model_path = build_model(args)
    vocabulary = json.loads((model_path / "config.json").read_text())["vocab_size"] if args.model else 0
    trajectories = make_trajectories(args.groups, args.group_size, args.min_len, args.max_len, args.seed,
                                     vocabulary or args.vocab_ranks)
    print(f"model: {describe_model(model_path, args)}, {count_params(model_path) / 1e6:.0f}M parameters, "
          f"{args.dtype}, on {'cuda' if on_gpu else 'cpu'}, {threads} torch threads a rank; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    tokens = describe_batch(trajectories, args)
    init_ray(num_cpus=4)
    pickle_by_value_for_ray()
    sides = start_ranks(args, model_path, threads, on_gpu)
    try:
        seconds, peaks = timed_steps(args, sides, trajectories)
    finally:
        sides.critic.shutdown()
        sides.actor.shutdown()
    if args.repetitions:
        report(args, on_gpu, tokens, seconds, peaks)


if __name__ == "__main__":
    main()
