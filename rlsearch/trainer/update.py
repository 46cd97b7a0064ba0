"""The updates of a step: the policy's, algo.ppo_epochs passes over algo.num_minibatches mini-batches, each one
optimizer step on the actor group; and the critic's (algo.advantage=gae), as many value-loss steps over the same
mini-batches."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..actor import ActorRanks, TrainSample
from ..algo import minibatch_bounds
from ..config import AlgoConfig, CriticConfig

if TYPE_CHECKING:
    from ..actor import CriticRanks
from .step_batch import minibatches


@dataclass
class PolicyUpdate:
    metrics: dict[str, float]  # actor/* averaged over the updates, actor/updates, time/old_logprob_s
    per_update: list[dict[str, float]]  # the actor group's metrics of each optimizer step, in order

    @property
    def changed_weights(self) -> bool:
        """False when every update was skipped for a NaN/inf loss or grad norm."""
        return any(update["actor/skipped_nonfinite"] == 0.0 for update in self.per_update)


def policy_update(actor: ActorRanks, samples: list[TrainSample], algo: AlgoConfig) -> PolicyUpdate:
    """With more than one update, the old policy's logprobs are computed once before the first (the PPO ratio of
    the first update is 1, later ones clip); with one, the training pass itself is the old policy (ratio 1). Later
    epochs take the mini-batches in the same order."""
    if not samples:
        raise ValueError("a policy update needs samples")
    started = time.perf_counter()
    if len(minibatch_bounds(len(samples), algo.num_minibatches)) * algo.ppo_epochs > 1:
        # on the step's samples: the mini-batches copy them, the trajectory records read them (actor_logprobs)
        if algo.routing_replay == "old":  # every update routes each token as this pass did
            old_logprobs, routing = actor.compute_logprobs_and_routing(samples)
            for sample, routed in zip(samples, routing, strict=True):
                sample.routed_experts = routed
        else:
            old_logprobs = actor.compute_logprobs(samples)
        for sample, logprobs in zip(samples, old_logprobs, strict=True):
            sample.old_logprobs = logprobs
    old_logprob_s = time.perf_counter() - started
    batches = minibatches(samples, algo)
    per_update = [actor.train_step(batch) for _ in range(algo.ppo_epochs) for batch in batches]
    metrics = {key: statistics.fmean(update[key] for update in per_update) for key in per_update[0]}
    skipped = [update["actor/skipped_nonfinite"] for update in per_update]
    metrics.update({
        # 1.0 only when no update changed the weights (the step's weights, and the engine's, stay as they were)
        "actor/skipped_nonfinite": min(skipped),
        "actor/skipped_updates": sum(skipped),
        "actor/updates": float(len(per_update)),
        "time/old_logprob_s": old_logprob_s,
    })
    return PolicyUpdate(metrics, per_update)


def critic_update(critic: CriticRanks, samples: list[TrainSample], algo: AlgoConfig, settings: CriticConfig
                  ) -> dict[str, float]:
    """The critic's value-loss steps over the policy update's mini-batches and passes, each a mean over its trained
    tokens; critic/* averaged over them, and critic/updates."""
    per_update = [critic.value_step(batch, settings) for _ in range(algo.ppo_epochs)
                  for batch in minibatches(samples, algo, loss_agg="token_mean")]
    metrics = {key: statistics.fmean(update[key] for update in per_update) for key in per_update[0]}
    metrics["critic/updates"] = float(len(per_update))
    return metrics
