"""A GRPO run's start-up. `load_and_check` runs what starts nothing: the model dir, the data and its scorers, the
model's layout and the memory plan. `start_run` then starts the run's parts into its RunParts: the tool servers, Ray
(model.dtype and weights.transport `auto` made concrete on the cluster's devices), the rollout engines and the actor
ranks side by side where the placement puts them, the weight sync and the probe sequence, then prints the placement
line; `startup_line` reports where the start-up's seconds went.

It may call the rooms below (config, data, reward's checks, memory, ray_setup, rollout, actor, weights) and
placement.py. Resuming from a checkpoint is the trainer's call (grpo.py, through actor_side.py), once start_run
returned."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from .. import STARTED_AT
from ..actor import ActorRanks, ActorWorkerSpec, CriticRanks, SamplingDistribution
from ..config import (
    ToolsConfig,
    TrainConfig,
    check_actor_devices,
    check_model_layout,
    check_same_tokenizer,
    check_train_model_files,
    dropout_turned_off,
    resolve_auto_keys,
    to_dict,
)
from ..data import QAExample, load_qa_dataset
from ..memory import check_train_memory, waits_for_cluster
from ..ray_setup import cluster_has_gpus, init_ray, ray_cpus, supervisor_ray_address
from ..reward import check_scorers, check_turn_scorers
from ..rollout import EnginePool, start_engines, start_frozen_judge, start_tool_servers, token_logit_bias
from ..weights import AdapterSync, WeightSync
from .placement import Placement, check_retriever_reachable, describe_placement, plan_placement
from .progress import RunParts
from .timing import timed

PROBE_CONTINUATION = "<search> who founded the town </search>"


@dataclass
class StartedRun:
    config: TrainConfig  # model.dtype and weights.transport `auto` made concrete on the cluster's devices
    start_actor: Callable[[], ActorRanks]  # new actor ranks of the run's spec and placement (to replace dead ones)
    seconds: dict[str, float]  # of each start-up phase, for startup_line
    # new critic ranks beside the given actor ranks (algo.advantage=gae; None without a critic)
    start_critic: Callable[[ActorRanks], CriticRanks] | None = None


def load_and_check(config: TrainConfig) -> list[QAExample]:
    """The run's examples, once the checks that need nothing started have passed."""
    check_train_model_files(config)
    if dropout_line := dropout_turned_off(config):
        print(dropout_line, flush=True)
    examples = []
    for path in config.data.train_files:
        examples.extend(load_qa_dataset(path))
    check_scorers(examples, config.reward)  # every data source has a scorer, every judge its settings
    if config.algo.advantage != "outcome":  # turn-level credit: every row's turn scorer is known
        check_turn_scorers(examples, config.reward)
    check_model_layout(config.model.path, config.actor, config.algo.routing_replay)
    if config.algo.advantage == "gae":  # the critic's model and layout
        critic_model = config.critic.model.path or config.model.path
        check_model_layout(critic_model, config.critic.ranks_config(config.actor), prefix="critic.")
        if critic_model != config.model.path:
            check_same_tokenizer(config.model.path, critic_model)
    # the memory plan: a run whose ranks or engines cannot fit stops here, before Ray, tool servers or actors start
    # (a cluster joined from a driver without a GPU: once Ray has joined it, in start_run)
    if memory_line := check_train_memory(config):
        print(memory_line, flush=True)
    return examples


def start_run(config: TrainConfig, examples: list[QAExample], parts: RunParts, output_dir: Path) -> StartedRun:
    """Starts the run's parts into `parts` as they start (RunParts.stop stops those that did, also after a failure
    here) and writes output_dir/config.json."""
    output_dir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}  # of each start-up phase, for the line that reports them
    with timed(seconds, "tool servers"):
        parts.tool_servers = start_tool_servers(config.tools)
    tools = parts.tool_servers.tools  # the config with the started servers' URLs filled in
    config, has_gpus = _join_ray(config, output_dir, seconds)
    import ray

    gpus, rollout = 1 if has_gpus else 0, config.rollout
    placement = plan_placement(config.trainer.placement, config.actor.world_size, gpus, config.trainer.ray_address,
                               rollout.num_engines, rollout.tensor_parallel_size)
    # reward.judge.engine: the frozen judge engine starts beside the rest, and stops with the engine pool
    frozen_judge = start_frozen_judge(config.reward.judge, config.trainer.seed, gpus)
    start_actor, start_critic, logit_bias = _start_engines_and_ranks(
        config, tools, placement, gpus, parts, seconds, [frozen_judge.actor] if frozen_judge is not None else [])
    if frozen_judge is not None:
        with timed(seconds, "frozen judge"):
            config = replace(config, reward=replace(config.reward, judge=frozen_judge.ready()))
    engine_bias = ray.get(parts.pool.engines[0].token_logit_bias.remote(), timeout=60)
    if engine_bias != logit_bias:
        raise RuntimeError(f"the engine's token logit bias {engine_bias} differs from the actor's {logit_bias}: "
                           f"the engine tokenises rollout.logit_bias differently from {config.model.path}'s "
                           "tokenizer")
    parts.weight_sync = _weight_sync(config, parts.actor)
    parts.probe_ids = ray.get(parts.pool.engines[0].probe_sequence.remote(examples[0].question, PROBE_CONTINUATION))
    line, engine_ips = describe_placement(config.trainer.placement, parts.actor.workers, parts.pool.engines)
    print(line, flush=True)
    check_retriever_reachable(tools, engine_ips)
    return StartedRun(config, start_actor, seconds, start_critic)


def _join_ray(config: TrainConfig, output_dir: Path, seconds: dict[str, float]) -> tuple[TrainConfig, bool]:
    """Ray started or joined; the config with its `auto` keys concrete (also in config.json), and whether the
    cluster has GPUs."""
    rollout = config.rollout
    with timed(seconds, "Ray"):
        init_ray(config.trainer.ray_address,
                 num_cpus=ray_cpus(config.actor.world_size, rollout.num_engines, rollout.tensor_parallel_size))
    # the cluster's GPUs, not this process's, decide: model.dtype and weights.transport `auto` become concrete here,
    # once, and everything below (and config.json) sees those values
    has_gpus = cluster_has_gpus()
    config = resolve_auto_keys(config, has_gpus)
    check_actor_devices(config.actor, has_gpus, config.model.dtype)  # before any engine or actor rank starts
    if waits_for_cluster(config) and (memory_line := check_train_memory(config, cluster_gpus=has_gpus)):
        print(memory_line, flush=True)
    (output_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
    return config, has_gpus


def _start_engines_and_ranks(
    config: TrainConfig, tools: ToolsConfig, placement: Placement, gpus: int, parts: RunParts,
    seconds: dict[str, float], helpers: list,
) -> tuple[Callable[[], ActorRanks], Callable[[ActorRanks], CriticRanks] | None, dict[int, float]]:
    """The engine pool (`helpers`: frozen engines started already, stopped with it), the actor ranks (`gpus` each)
    and the critic's beside them (algo.advantage=gae: half of each rank's devices each) into `parts`; returns the
    actor and critic factories and the token logit bias the ranks score under."""
    def start_pool() -> EnginePool:
        with timed(seconds, "rollout engines"):
            # under the supervisor the engines outlive this driver, and a restarted one takes them over
            lora = config.actor.lora
            return start_engines(config.model, config.rollout, tools, config.trainer.seed,
                                 lora_rank=lora.rank if lora.sync == "adapter" else 0, helpers=helpers,
                                 detached=bool(supervisor_ray_address()), **placement.pool_options)

    # the engines and the actor ranks start side by side (each is mostly one process importing and loading); the
    # ranks, which start faster, after the tokenizer the actor's distribution needs has been read
    with ThreadPoolExecutor(1, thread_name_prefix="engine-start") as starter, timed(seconds, "side by side"):
        starting_pool = starter.submit(start_pool)
        try:
            with timed(seconds, "actor ranks"):
                logit_bias = _token_logit_bias(config)
                # kept: actor ranks that die are replaced by new ones (trainer.max_actor_restarts). Under the
                # supervisor the ranks outlive this driver as the engines do, and a restarted one takes them
                # over (not in a split placement, whose group the trainer reserves)
                actor_spec, start_critic = _actor_spec(config, logit_bias), None
                share = 1.0
                if config.algo.advantage == "gae":  # not detached: a restarted driver starts its critic anew
                    share = 0.5
                    start_critic = partial(_start_critic, _critic_spec(config, actor_spec), gpus)
                start_actor = partial(
                    ActorRanks, actor_spec, num_gpus_per_rank=gpus, gpu_share=share,
                    detached=bool(supervisor_ray_address()) and not placement.actor_options, **placement.actor_options)
                parts.actor = start_actor()
            if start_critic is not None:
                with timed(seconds, "critic ranks"):
                    parts.critic = start_critic(parts.actor)
        finally:
            parts.pool = starting_pool.result()  # also when the actor failed: close() then stops the engines
    return start_actor, start_critic, logit_bias


def _start_critic(spec: ActorWorkerSpec, gpus: int, actor: ActorRanks) -> CriticRanks:
    """The critic's ranks on the actor ranks' devices, half of each GPU (the actor's ranks take the other half)."""
    return CriticRanks(spec, num_gpus_per_rank=gpus, gpu_share=0.5, beside=actor)


def _critic_spec(config: TrainConfig, actor_spec: ActorWorkerSpec) -> ActorWorkerSpec:
    """The critic ranks' spec: critic.model.path (default the policy's) with a value head, the critic's layout and
    optimizer, the actor's dtype and seed."""
    return replace(actor_spec, model_path=config.critic.model.path or config.model.path, value_model=True,
                   actor=config.critic.ranks_config(config.actor))


def _weight_sync(config: TrainConfig, actor: ActorRanks) -> WeightSync | AdapterSync:
    weights, lora = config.weights, config.actor.lora
    if lora.sync == "adapter":
        return AdapterSync(actor, lora.rank, lora.alpha, weights.timeout_s)
    return WeightSync(
        actor, weights.bucket_mb, weights.transport, weights.timeout_s, config.rollout.tensor_parallel_size,
        delta=weights.delta, delta_full_every=weights.delta_full_every,
        # syncs land on rollouts in flight only with async_steps >= 1: else staging first would only cost memory
        stage_while_generating=weights.stage_while_generating and config.rollout.update_weights_in_flight
        and config.rollout.async_steps >= 1,
    )


def _token_logit_bias(config: TrainConfig) -> dict[int, float]:
    """rollout.logit_bias per token, as the engines apply it (read with the model's tokenizer: ~3.5 s here with its
    imports, none without a bias)."""
    if not config.rollout.logit_bias:
        return {}
    from transformers import AutoTokenizer

    return token_logit_bias(AutoTokenizer.from_pretrained(config.model.path), config.rollout.logit_bias)


def _actor_spec(config: TrainConfig, logit_bias: dict[int, float]) -> ActorWorkerSpec:
    """The actor ranks' spec: they score tokens under the distribution the engines sample them from."""
    return ActorWorkerSpec(
        model_path=config.model.path, dtype=config.model.dtype, actor=config.actor, algo=config.algo,
        sampling=SamplingDistribution(config.rollout.temperature, logit_bias), seed=config.trainer.seed,
        # the LR schedule counts optimizer updates
        total_steps=config.trainer.total_steps * config.algo.num_minibatches * config.algo.ppo_epochs,
        trains_beside_rollout=config.rollout.async_steps > 0,
    )


def startup_line(seconds: dict[str, float]) -> str:
    """How long the driver took to start, from rlsearch's start in its process, and where the time went."""
    total = time.time() - STARTED_AT
    phases = [f"{name} {seconds[name]:.1f}" for name in ("tool servers", "Ray") if name in seconds]
    critic = f" then critic ranks {seconds['critic ranks']:.1f}" if "critic ranks" in seconds else ""
    phases.append(f"rollout engines {seconds.get('rollout engines', 0.0):.1f} and actor ranks "
                  f"{seconds.get('actor ranks', 0.0):.1f}{critic} side by side "
                  f"({seconds.get('side by side', 0.0):.1f})")
    for name in ("frozen judge", "resume"):  # the judge engine: what it took past the side-by-side start
        if name in seconds:
            phases.append(f"{name} {seconds[name]:.1f}")
    rest = total - sum(seconds.get(name, 0.0) for name in ("tool servers", "Ray", "side by side", "frozen judge",
                                                           "resume"))
    return f"[rlsearch] started in {total:.1f} s: {', '.join(phases)}, the rest (imports, data, checks) {rest:.1f}"
