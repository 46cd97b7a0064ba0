"""Actor test inputs shared by the layout and checkpoint tests: HF reference logprobs, a scored packed batch, and
an actor spec for a layout."""

from __future__ import annotations

import ray
import torch

from rlsearch.actor import MODEL_DISTRIBUTION, ActorWorkerSpec, SamplingDistribution, TrainSample
from rlsearch.algo import loss_token_weights
from rlsearch.config import ActorConfig, AlgoConfig


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
        ids = torch.randint(0, 151_000, (length,), generator=generator).tolist()
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


def actor_spec(
    model_dir, tp: int, pp: int, dp: int, extra: dict, sampling: SamplingDistribution = MODEL_DISTRIBUTION
) -> ActorWorkerSpec:
    actor = ActorConfig(tp=tp, pp=pp, dp=dp, **{"lr": 1e-5, "max_tokens_per_microbatch": 160, **extra})
    return ActorWorkerSpec(
        model_path=str(model_dir), dtype="float32", actor=actor, algo=AlgoConfig(), sampling=sampling,
        total_steps=4, seed=1,
    )


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
