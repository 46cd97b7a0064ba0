"""Supervised warm start on the Megatron actor: chat trajectories in, an HF model dir out (model.path for GRPO).

The same actor group, model code and packed micro-batches as GRPO training; the loss is the mean negative
log-likelihood of the assistant tokens (tool tokens are context only), token-weighted over each batch. With
save_interval, run checkpoints (weights, Adam's state, RNG, data position) go under output_dir/checkpoints as GRPO's
do, and a run started again on the same output_dir (resume=auto) continues from the newest to the weights of the run
that was never stopped. One started with anything that would end it elsewhere (a data file's contents, Adam's
settings, the schedule, ...) is refused naming it, before anything is written.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..actor import MODEL_DISTRIBUTION, ActorRanks, ActorWorkerSpec, TrainSample
from ..algo import loss_token_weights
from ..checkpoint import CheckpointError, CheckpointStore, load_run_checkpoint, write_hf_model
from ..config import (
    AlgoConfig,
    ConfigError,
    SFTConfig,
    check_actor_devices,
    check_model_files,
    check_model_layout,
    resolve_auto_keys,
    to_dict,
)
from ..data.chat import ChatExample, load_chat_dataset
from ..files import file_sha256
from ..ray_setup import cluster_has_gpus, init_ray
from ..runlog import RunLogger, plot_run
from .checkpoints import ResumePoint, check_optimizer_layout, load_actor_state
from .sampler import EpochSampler, SamplerState

HF_OUTPUT = "hf"


@dataclass
class SFTSummary:
    model_dir: Path
    tensorboard_dir: Path
    curves: Path | None
    steps: int
    examples: int
    seconds: float
    first_loss: float
    last_loss: float
    resumed_step: int = 0

    def render(self) -> str:
        resumed = f" (resumed after step {self.resumed_step})" if self.resumed_step else ""
        lines = [
            "",
            f"rlsearch sft: {self.steps} steps over {self.examples} examples in {self.seconds:.0f} s{resumed}, "
            f"loss {self.first_loss:.3f} -> {self.last_loss:.3f}",
            f"  model            : {self.model_dir}   (train from it: model.path={self.model_dir})",
        ]
        if self.curves:
            lines.append(f"  curves           : {self.curves}")
        lines.append(f"  TensorBoard      : tensorboard --logdir {self.tensorboard_dir} --host 127.0.0.1")
        return "\n".join(lines)


def _load_examples(config: SFTConfig) -> list[ChatExample]:
    from transformers import AutoTokenizer

    check_model_files(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    examples: list[ChatExample] = []
    for path in config.data.train_files:
        examples.extend(load_chat_dataset(path, tokenizer, config.data.max_tokens))
    return examples


def _train_samples(examples: list[ChatExample]) -> list[TrainSample]:
    weights = loss_token_weights([example.loss_mask for example in examples], "token_mean")
    return [
        TrainSample(example.token_ids, example.response_start, example.loss_mask, token_weights=w)
        for example, w in zip(examples, weights)
    ]


# the actor keys that change the weights a run ends with (its parallel layout does not: a resume reshards; Adam's eps
# is Megatron's default, no key), and the distributed optimizer, which lays its checkpoints out otherwise
_ACTOR_SETTINGS = ("lr", "min_lr", "lr_warmup_steps", "lr_decay_style", "weight_decay", "adam_beta1", "adam_beta2",
                   "clip_grad", "moe_aux_loss_coef", "moe_z_loss_coef", "use_distributed_optimizer")
_START_OVER = "start over with resume=none or another output_dir"


def _settings(config: SFTConfig, total_steps: int) -> dict[str, Any]:
    """What a resumed run must share with the run that saved the checkpoint for the two to end with the same
    weights, by name: the model, the data (each file's contents too: one written again under its name holds other
    rows at the saved position), their order, the step count, the learning-rate schedule and Adam's settings (a
    resumed Adam keeps the saved betas whatever the config says)."""
    files = [Path(path).resolve() for path in config.data.train_files]
    return {
        "model.path": str(Path(config.model.path).resolve()), "model.dtype": config.model.dtype,
        "data.train_files": [str(path) for path in files],
        **{f"the contents (sha256) of {path}": file_sha256(path) for path in files},
        "data.batch_size": config.data.batch_size, "data.shuffle": config.data.shuffle, "seed": config.seed,
        "the step count (data.max_steps, data.epochs)": total_steps,
        **{f"actor.{key}": getattr(config.actor, key) for key in _ACTOR_SETTINGS},
    }


def _checkpoint_to_resume(config: SFTConfig, store: CheckpointStore, settings: dict) -> tuple[ResumePoint, dict] | None:
    """The newest complete checkpoint of this run (resume=auto), or None; a checkpoint saved with other `settings` is
    refused (ConfigError) naming each one that differs, before anything is written."""
    if config.resume == "none":
        return None
    path, skipped = store.newest_complete(check_contents=True)
    for warning in skipped:
        print(f"[rlsearch sft] {warning}", flush=True)
    if path is None:
        return None
    try:
        manifest, state = load_run_checkpoint(path)
    except CheckpointError as error:
        raise ConfigError(f"'resume' auto: {error}") from error
    saved = state.get("settings", {})
    check_optimizer_layout(path, saved.get("actor.use_distributed_optimizer", False), config.actor, _START_OVER)
    changed = [key for key in settings if saved.get(key) != settings[key]]
    if changed:
        differences = "; ".join(
            f"{key} {repr(saved[key]) if key in saved else 'not recorded'} there, {settings[key]!r} here"
            for key in changed)
        raise ConfigError(f"the checkpoint {path} is of another SFT run ({differences}): a resumed run continues at "
                          "its data position with its Adam state, so each must be as it was when it was saved. Give "
                          f"them as they were (a data file: its contents then), or {_START_OVER}")
    return ResumePoint(path, manifest["layout"], state["step"], SamplerState(**state["sampler"])), state


def _save_checkpoint(store: CheckpointStore, step: int, write_model: Callable[[str], None], config: SFTConfig,
                     sampler: SamplerState, settings: dict, first_loss: float) -> Path:
    """The actor state (`write_model(dir)`) as the checkpoint of `step`, with the data position and the `settings`
    a resume compares."""
    state = {"sampler": asdict(sampler), "settings": settings, "first_loss": first_loss}
    info = {"layout": config.actor.layout, "contents": ["model", "optimizer", "scheduler", "rng"]}
    return store.save(step, write_model, state, config.model.path, info)


def run_sft(config: SFTConfig) -> SFTSummary:
    """Train, then write the model to output_dir/hf. Refuses an output_dir that already holds a trained model."""
    started = time.perf_counter()
    output_dir = Path(config.output_dir)
    model_dir = output_dir / HF_OUTPUT
    if model_dir.exists() and any(model_dir.iterdir()):
        raise ConfigError(f"'output_dir' {output_dir} already holds a fine-tuned model ({model_dir}); choose another "
                          "output_dir or remove it")
    examples = _load_examples(config)
    check_model_layout(config.model.path, config.actor)
    data = config.data
    steps_per_epoch = math.ceil(len(examples) / data.batch_size)
    total_steps = data.max_steps or steps_per_epoch * data.epochs
    store = CheckpointStore(output_dir, keep=1)
    settings = _settings(config, total_steps)
    resume = _checkpoint_to_resume(config, store, settings)  # a checkpoint of another run stops it before Ray starts
    output_dir.mkdir(parents=True, exist_ok=True)
    world = config.actor.world_size
    init_ray(config.ray_address, num_cpus=world)
    has_gpus = cluster_has_gpus()  # the cluster's GPUs decide model.dtype auto, as in training
    config = resolve_auto_keys(config, has_gpus)
    check_actor_devices(config.actor, has_gpus, config.model.dtype)
    (output_dir / "sft_config.json").write_text(json.dumps(to_dict(config), indent=2))
    spec = ActorWorkerSpec(
        model_path=config.model.path, dtype=config.model.dtype, actor=config.actor, algo=AlgoConfig(),
        sampling=MODEL_DISTRIBUTION, total_steps=total_steps, seed=config.seed,
    )
    actor = ActorRanks(spec, num_gpus_per_rank=1 if has_gpus else 0)
    sampler = EpochSampler(examples, seed=config.seed, shuffle=data.shuffle)
    resumed_step, first_loss = 0, float("nan")
    if resume is not None:
        point, state = resume
        resharded = load_actor_state(actor, point, config.actor.layout)
        sampler.restore(point.sampler)
        resumed_step, first_loss = point.step, state["first_loss"]
        print(f"[rlsearch sft] resumed from {point.path} after step {resumed_step}{resharded}", flush=True)
    logger = RunLogger(output_dir, log_trajectories=False, resumed_step=resumed_step)
    print(f"[rlsearch sft] {len(examples)} examples, batch {data.batch_size}, {total_steps} steps "
          f"({total_steps / steps_per_epoch:.1f} epochs)", flush=True)
    loss = first_loss
    try:
        for step in range(resumed_step + 1, total_steps + 1):
            metrics = actor.sft_step(_train_samples(sampler.next_batch(data.batch_size)))
            metrics["sft/epoch"] = sampler.state.epoch + sampler.state.position / len(examples)
            loss = metrics["sft/loss"]
            first_loss = loss if step == 1 else first_loss
            logger.log_metrics(step, metrics)
            if step % config.log_interval == 0 or step == total_steps:
                elapsed = time.perf_counter() - started
                print(f"[rlsearch sft] step {step}/{total_steps} | loss {loss:.4f} | "
                      f"grad norm {metrics['actor/grad_norm']:.3f} | epoch {metrics['sft/epoch']:.2f} | "
                      f"{elapsed:.0f} s", flush=True)
            if config.save_interval and step % config.save_interval == 0 and step < total_steps:
                saved = _save_checkpoint(store, step, actor.save_checkpoint, config, sampler.state, settings,
                                         first_loss)
                print(f"[rlsearch sft] checkpoint saved: {saved}", flush=True)
        written = write_hf_model(actor.hf_state_dict().items(), model_dir, config.model.path)
    finally:
        actor.shutdown()
        logger.close()
    return SFTSummary(
        model_dir=written, tensorboard_dir=logger.tensorboard_dir, curves=plot_run(output_dir), steps=total_steps,
        examples=len(examples), seconds=time.perf_counter() - started, first_loss=first_loss, last_loss=loss,
        resumed_step=resumed_step,
    )
