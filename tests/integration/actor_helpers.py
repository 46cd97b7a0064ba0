"""Actor test inputs shared by the layout and checkpoint tests: HF reference logprobs, a scored packed batch, a batch of
multi-segment trajectories (prefix trees) and plain samples, and an actor spec for a layout."""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, SamplingDistribution, TrainSample
from rlsearch.algo import loss_token_weights
from rlsearch.config import ActorConfig, AlgoConfig
from tests.models import TEST_VOCAB_RANKS


def hf_logprobs(model_dir, samples: list[TrainSample]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for sample in samples:
            logits = model(torch.tensor([sample.token_ids])).logits[0]
            logprobs = torch.log_softmax(logits.float(), -1)[sample.response_start - 1 : -1]
            result.append(logprobs.gather(1, torch.tensor(sample.token_ids[sample.response_start :])[:, None])[:, 0])
    return result


def scored_batch(hf_logprobs_fn) -> tuple[list[TrainSample], list[torch.Tensor]]:
    """Eight sequences of 30-79 tokens with masked observation spans, off-policy old logprobs (so ratios vary and
    some clip) and advantages that do not cancel."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(30 + 7 * i, 6 + i) for i in range(8)]  # (length, response_start)
    samples = []
    for length, start in shapes:
        ids = torch.randint(0, TEST_VOCAB_RANKS, (length,), generator=generator).tolist()
        mask = [0 if 8 <= i < 14 else 1 for i in range(length - start)]
        samples.append(TrainSample(ids, start, mask))
    reference = hf_logprobs_fn(samples)
    weights = loss_token_weights([s.loss_mask for s in samples], "token_mean")
    for index, (sample, logprobs, w) in enumerate(zip(samples, reference, weights)):
        noise = 0.3 * torch.randn(len(logprobs), generator=generator)
        sample.old_logprobs = (logprobs + noise).tolist()
        sample.advantage = [1.0, -0.5, 0.8, 0.3, -1.2, 0.6, 0.9, -0.2][index]
        sample.token_weights = w
    return samples, reference


def _trajectory_segments(generator: torch.Generator, shared: list[int | None]) -> list[tuple[list[int], int]]:
    """(token ids, response start) per segment: each segment repeats `shared[i]` tokens of the previous one (None:
    all of it, an agent that only appends) and adds a new prompt tail and a response."""
    segments, history = [], torch.randint(0, TEST_VOCAB_RANKS, (14,), generator=generator).tolist()
    for keep in shared:
        tail = torch.randint(0, TEST_VOCAB_RANKS, (6,), generator=generator).tolist()
        prompt = history if keep is None else history[:keep] + tail
        response = torch.randint(0, TEST_VOCAB_RANKS, (18,), generator=generator).tolist()
        segments.append((prompt + response, len(prompt)))
        history = prompt + response
    return segments


def long_sequence_batch(model_dir) -> tuple[list[TrainSample], list[torch.Tensor]]:
    """Re-rendered multi-segment trajectories (segments sharing prefixes of different lengths, and none), plain
    samples of different lengths and a GRPO group's samples sharing their prompt, scored off-policy like
    `scored_batch`; with the HF reference logprobs."""
    generator = torch.Generator().manual_seed(3)
    shapes = [
        (_trajectory_segments(generator, [None, 20, 33]), 0),  # re-rendered: prefixes of different lengths
        (_trajectory_segments(generator, [None, None, None]), 1),  # appended: each segment extends the one before
        (_trajectory_segments(generator, [None, 0]), 2),  # nothing shared after the first segment
    ]
    samples = [TrainSample(ids, start, [0 if 5 <= i < 9 else 1 for i in range(len(ids) - start)], prefix_group=g)
               for segments, g in shapes for ids, start in segments]
    for length in (23, 61, 40):
        ids = torch.randint(0, TEST_VOCAB_RANKS, (length,), generator=generator).tolist()
        samples.append(TrainSample(ids, 9, [1] * (length - 9)))
    prompt = torch.randint(0, TEST_VOCAB_RANKS, (12,), generator=generator).tolist()
    for length in (9, 14, 6):  # a GRPO group: one prompt, trained once where merged
        response = torch.randint(0, TEST_VOCAB_RANKS, (length,), generator=generator).tolist()
        samples.append(TrainSample(prompt + response, len(prompt), [1] * length, prompt_group=0))
    # two more of the group: the first's twin, and one branching after its 4th token (merged, their shared rows are
    # projected once and each position still gets its own logprob and gradient)
    first = samples[-3].token_ids
    samples.append(TrainSample(list(first), len(prompt), [1] * 9, prompt_group=0))
    samples.append(TrainSample(first[:len(prompt) + 4] + [1, 2, 3], len(prompt), [1] * 7, prompt_group=0))
    reference = hf_logprobs(model_dir, samples)
    weights = loss_token_weights([s.loss_mask for s in samples], "token_mean")
    for index, (sample, logprobs, w) in enumerate(zip(samples, reference, weights)):
        sample.old_logprobs = (logprobs + 0.3 * torch.randn(len(logprobs), generator=generator)).tolist()
        sample.advantage = (1.0, -0.6, 0.4, -1.1, 0.8)[index % 5]
        sample.token_weights = w
    return samples, reference


def actor_spec(
    model_dir, tp: int, pp: int, dp: int, extra: dict, sampling: SamplingDistribution = MODEL_DISTRIBUTION
) -> ActorWorkerSpec:
    actor = ActorConfig(tp=tp, pp=pp, dp=dp, **{"lr": 1e-5, "max_tokens_per_microbatch": 160, **extra})
    return ActorWorkerSpec(
        model_path=str(model_dir), dtype="float32", actor=actor, algo=AlgoConfig(), sampling=sampling,
        total_steps=4, seed=1,
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts of the same tensor names."""
    assert set(a) == set(b)
    return max((a[name] - b[name]).abs().max().item() for name in a)


def sent_tensors(group, bucket_mb: int) -> dict[str, torch.Tensor]:
    """What the weight path sends (every stage's rank-local export), received on the driver (the same object-store
    path the shm transport's engines read); asserts that only each stage's sender sent and no tensor came twice."""
    from rlsearch.weights.bucket import unpack_bucket
    from rlsearch.weights.shm import ExportPlan

    received = []
    plan = ExportPlan(bucket_mb * 1024 * 1024, stage_in_shared_memory=False)
    for workers in group.stage_workers():
        streams = [worker.export_weight_buckets.options(num_returns="streaming").remote(plan) for worker in workers]
        received += [(name, tensor.clone()) for ref in streams[0] for name, tensor in unpack_bucket(ray.get(ref))]
        assert all(not list(stream) for stream in streams[1:]), "a rank other than the stage's sender sent weights"
    tensors = dict(received)
    assert len(tensors) == len(received), "a tensor was sent twice"
    return tensors


def sent_adapters(group) -> dict[str, torch.Tensor]:
    """What an adapter sync sends (every stage's `stage_adapters`); asserts that each stage's sender alone sent and
    no name came twice."""
    stages = group.stage_workers()
    exported = ray.get([worker.stage_adapters.remote() for workers in stages for worker in workers])
    assert sum(bool(part) for part in exported) == len(stages), "a rank other than a stage's sender sent adapters"
    adapters = {name: tensor for part in exported for name, tensor in part.items()}
    assert len(adapters) == sum(len(part) for part in exported), "an adapter factor was sent twice"
    return adapters


def save_lora_checkpoint(run_dir, step: int, group, model_dir, tp: int, lora) -> Path:
    """A run's checkpoint of a LoRA actor group (`group`, at TP `tp`, trained with `lora`): its adapters and their
    Adam state, and the manifest `rlsearch convert` reads."""
    from dataclasses import asdict

    from rlsearch.checkpoint import CheckpointStore

    info = {"layout": {"tp": tp, "pp": 1, "dp": 1}, "architecture": "qwen2", "dtype": "float32",
            "transformer_impl": "local", "contents": ["model", "optimizer", "scheduler", "rng"], "lora": asdict(lora)}
    state = {"config": {"model": {"path": str(model_dir)}}}
    return CheckpointStore(run_dir).save(step, group.save_checkpoint, state, model_dir, info)
