"""CriticRanks: the value model of PPO with a learned critic (algo.advantage=gae), as Megatron ranks of its own.

A critic is the policy's transformer with a scalar head (`ActorWorkerSpec.value_model`), trained by regression on the
returns. Its ranks are `ActorRanks` of their own layout and process group, placed on the actor ranks' devices
(`ActorRanks`' ``beside``): the two models take turns, never training at once."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from ..algo import ValueSettings, critic_objective, value_metrics
from .batch import TrainSample
from .ranks import ActorRanks

# the sums critic_objective returns per rank (value_metrics reads them once added up)
VALUE_STAT_KEYS = ("value_loss", "value_clip_tokens", "tokens", "value_sum", "return_sum", "return_sq_sum",
                   "error_sum", "error_sq_sum")


class CriticRanks(ActorRanks):
    """`ActorRanks` of a critic's spec: values of samples' response tokens and value-loss steps (its checkpoints,
    placement and shutdown as the actor's)."""

    def compute_values(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Per sample, the critic's value at each response token (of the state before it)."""
        results = self._on_every_rank("compute_values", samples)
        return [row for shard in self._output_by_dp_rank(results) for row in shard]

    def value_step(self, samples: Sequence[TrainSample], settings: ValueSettings) -> dict[str, float]:
        """One optimizer step of the value loss towards each sample's `returns`, clipped around its `old_values` by
        settings.value_clip (the critic config), aggregated by its `token_weights`; critic/* metrics of the step."""
        per_dp, skipped = self._train(samples, partial(critic_objective, settings=settings))
        summed = {key: sum(result[key] for result in per_dp) for key in VALUE_STAT_KEYS}
        return {
            **value_metrics(summed),
            "critic/grad_norm": per_dp[0]["grad_norm"],
            "critic/lr": per_dp[0]["lr"],
            "critic/skipped_nonfinite": skipped,
        }
