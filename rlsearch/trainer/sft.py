"""Supervised warm start on the Megatron actor: chat trajectories in, an HF model dir out (model.path for GRPO).

The same actor group, model code and packed micro-batches as GRPO training; the loss is the mean negative
log-likelihood of the assistant tokens (tool tokens are context only), token-weighted over each batch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..actor import MODEL_DISTRIBUTION, ActorRanks, ActorWorkerSpec, TrainSample
from ..algo import loss_token_weights
from ..checkpoint import write_hf_model
from ..config import (
    AlgoConfig,
    ConfigError,
    SFTConfig,
    check_actor_devices,
    check_model_dir,
    check_model_layout,
    resolve_auto_keys,
    to_dict,
)
from ..data.chat import ChatExample, load_chat_dataset
from ..ray_setup import cluster_has_gpus, init_ray
from ..runlog import RunLogger, plot_run
from .sampler import EpochSampler

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

    def render(self) -> str:
        lines = [
            "",
            f"rlsearch sft: {self.steps} steps over {self.examples} examples in {self.seconds:.0f} s, "
            f"loss {self.first_loss:.3f} -> {self.last_loss:.3f}",
            f"  model            : {self.model_dir}   (train from it: model.path={self.model_dir})",
        ]
        if self.curves:
            lines.append(f"  curves           : {self.curves}")
        lines.append(f"  TensorBoard      : tensorboard --logdir {self.tensorboard_dir} --host 127.0.0.1")
        return "\n".join(lines)


def _load_examples(config: SFTConfig) -> list[ChatExample]:
    from transformers import AutoTokenizer

    check_model_dir(config.model.path)
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
    logger = RunLogger(output_dir, log_trajectories=False)
    sampler = EpochSampler(examples, seed=config.seed, shuffle=data.shuffle)
    losses: list[float] = []
    print(f"[rlsearch sft] {len(examples)} examples, batch {data.batch_size}, {total_steps} steps "
          f"({total_steps / steps_per_epoch:.1f} epochs)", flush=True)
    try:
        for step in range(1, total_steps + 1):
            metrics = actor.sft_step(_train_samples(sampler.next_batch(data.batch_size)))
            metrics["sft/epoch"] = sampler.state.epoch + sampler.state.position / len(examples)
            losses.append(metrics["sft/loss"])
            logger.log_metrics(step, metrics)
            if step % config.log_interval == 0 or step == total_steps:
                elapsed = time.perf_counter() - started
                print(f"[rlsearch sft] step {step}/{total_steps} | loss {metrics['sft/loss']:.4f} | "
                      f"grad norm {metrics['actor/grad_norm']:.3f} | epoch {metrics['sft/epoch']:.2f} | "
                      f"{elapsed:.0f} s", flush=True)
        written = write_hf_model(actor.hf_state_dict().items(), model_dir, config.model.path)
    finally:
        actor.shutdown()
        logger.close()
    return SFTSummary(
        model_dir=written, tensorboard_dir=logger.tensorboard_dir, curves=plot_run(output_dir), steps=total_steps,
        examples=len(examples), seconds=time.perf_counter() - started, first_loss=losses[0], last_loss=losses[-1],
    )
