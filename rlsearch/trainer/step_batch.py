"""From scored trajectories to what the actor trains on: the groups a step keeps (algo.filter_groups,
data.oversample), overlong masking (algo.overlong), advantages (per trajectory, or per turn: algo.advantage) and
loss-aggregation weights, and the mini-batches of the step's PPO updates (algo.num_minibatches)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..actor import TrainSample
from ..algo import gigpo_advantages, groups_with_signal, loss_token_weights, minibatch_bounds, turn_return_advantages
from ..config import AlgoConfig
from ..rollout import Trajectory
from .estimates import trajectory_advantages

if TYPE_CHECKING:
    import torch


TURN_CREDIT = ("turn_returns", "gigpo")  # the estimators that read every turn's reward


def outcome(trajectory: Trajectory) -> float:
    """The correctness score: scores["correct"] when the scorer sets one (an LLM judge), else exact match."""
    scores = trajectory.scores
    return scores.get("correct", scores["em"])


def is_overlong(trajectory: Trajectory, algo: AlgoConfig) -> bool:
    """Cut for one of algo.overlong_reasons."""
    return any(reason in algo.overlong_reasons for reason in trajectory.truncations)


@dataclass
class StepBatch:
    """The trajectories a step trains on, and what was left out of the rolled-out ones."""

    trajectories: list[Trajectory]  # not failed, in a kept group, within data.batch_size groups; rollout order
    groups_kept: int = 0  # groups with a learning signal (all of them with algo.filter_groups off)
    groups_dropped: int = 0  # same outcome for every sample (algo.filter_groups)
    groups_trained: int = 0  # the first data.batch_size kept groups
    dropped_by_outcome: Counter = field(default_factory=Counter)  # "none correct" / "all correct" -> groups

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/groups_kept": float(self.groups_kept),
            "rollout/groups_dropped": float(self.groups_dropped),
            "rollout/groups_trained": float(self.groups_trained),
        }

    def describe_dropped(self) -> str:
        """e.g. "none correct" or "3 none correct, 1 all correct"."""
        if len(self.dropped_by_outcome) == 1:
            return next(iter(self.dropped_by_outcome))
        return ", ".join(f"{count} {kind}" for kind, count in sorted(self.dropped_by_outcome.items()))


def select_groups(trajectories: list[Trajectory], algo: AlgoConfig, max_groups: int) -> StepBatch:
    """The first `max_groups` groups (in rollout order) that algo.filter_groups keeps. Failed trajectories (a user
    agent raised or timed out) are left out first, also of their group's outcome."""
    usable = [t for t in trajectories if not t.failed]
    order = list(dict.fromkeys(t.group_id for t in usable))
    kept = order
    dropped_by_outcome: Counter = Counter()
    if algo.filter_groups:
        kept = groups_with_signal([outcome(t) for t in usable], [t.group_id for t in usable])
        for group in set(order) - set(kept):
            correct = next(outcome(t) for t in usable if t.group_id == group) > 0
            dropped_by_outcome["all correct" if correct else "none correct"] += 1
    trained = set(kept[:max_groups])
    return StepBatch(
        trajectories=[t for t in usable if t.group_id in trained], groups_kept=len(kept),
        groups_dropped=len(order) - len(kept), groups_trained=len(trained), dropped_by_outcome=dropped_by_outcome,
    )


def train_samples(trajectories: list[Trajectory], algo: AlgoConfig) -> list[TrainSample]:
    """What the actor trains on: advantages per trajectory (`trajectory_advantages`: GRPO's, RLOO's, ...; the
    per-token estimators' come later, `token_estimates`) and loss-aggregation weights per token (over the whole
    list; `minibatches` re-weights per update), over the tokens the policy sampled (all response tokens with
    algo.mask_observations false). Trajectories a user agent failed are left out (also of their group's statistics);
    each segment of a trajectory is a sample with the trajectory's advantage, in the trajectory's prefix group and
    its GRPO group's prompt group (the actor trains a group's shared prefixes once, actor.merge_prefixes). With
    algo.overlong=mask a trajectory cut for one of algo.overlong_reasons keeps its place in its group's statistics
    but trains no token. With turn-level credit (algo.advantage turn_returns | gigpo) every token gets its turn's
    advantage instead (`token_advantages`).
    """
    trained = [t for t in trajectories if not t.failed]
    if not trained:
        return []
    advantages = trajectory_advantages(trained, algo)
    per_turn = turn_advantages(trained, advantages, algo)
    per_token = None if per_turn is None else [
        token_advantages(t, own, advantage) for t, own, advantage in zip(trained, per_turn, advantages.tolist())]
    segments = [(t, segment, advantage, index, position)
                for index, (t, advantage) in enumerate(zip(trained, advantages.tolist()))
                for position, segment in enumerate(t.segments)]
    masks = []
    for trajectory, segment, _, _, _ in segments:
        if algo.overlong == "mask" and is_overlong(trajectory, algo):
            masks.append([0] * len(segment.loss_mask))
        elif algo.mask_observations:
            masks.append(segment.loss_mask)
        else:  # the ablation: tool output trained as if sampled (it has no rollout logprobs, so no TIS or drift)
            masks.append([1] * len(segment.loss_mask))
    weights = loss_token_weights(masks, algo.loss_agg)
    prompt_groups: dict[object, int] = {}
    return [
        TrainSample(
            token_ids=segment.prompt_ids + segment.response_ids, response_start=len(segment.prompt_ids),
            loss_mask=mask, advantage=float(advantage), token_weights=w,
            advantages=per_token[index][position] if per_token is not None else None,
            rollout_logprobs=segment.rollout_logprobs if algo.mask_observations else None,
            prefix_group=index if len(trajectory.segments) > 1 else None,
            prompt_group=prompt_groups.setdefault(trajectory.group_id, len(prompt_groups)),
        )
        for (trajectory, segment, advantage, index, position), mask, w in zip(segments, masks, weights)
    ]


def turn_advantages(trajectories: list[Trajectory], outcome_advantages: torch.Tensor, algo: AlgoConfig
                    ) -> list[list[float]] | None:
    """Per trajectory, each turn's advantage under algo.advantage turn_returns or gigpo from its turns' rewards
    (Turn.reward, set by rlsearch.reward.score_turns); None for the other estimators."""
    if algo.advantage not in TURN_CREDIT:
        return None
    if any(turn.reward is None for t in trajectories for turn in t.turns):
        raise ValueError(f"algo.advantage={algo.advantage} needs every turn's reward: score the trajectories' turns "
                         "first (rlsearch.reward.score_turns)")
    rewards = [[turn.reward for turn in t.turns] for t in trajectories]
    groups = [t.group_id for t in trajectories]
    norm, eps, gamma, weight = algo.norm_adv_by_std, algo.adv_eps, algo.turn_gamma, algo.turn_weight
    if algo.advantage == "turn_returns":
        return turn_return_advantages(outcome_advantages, rewards, groups, gamma, weight, norm, eps)
    return gigpo_advantages(outcome_advantages, rewards, [t.reward for t in trajectories],
                            [turn_states(t) for t in trajectories], groups, gamma, weight, norm, eps)


def turn_states(trajectory: Trajectory) -> list[tuple[str, ...]]:
    """The state each turn starts from, as GiGPO's step groups compare them: the observations the trajectory had
    received before it, in order (every first turn starts from the prompt alone)."""
    observations = tuple(turn.observation or "" for turn in trajectory.turns)
    return [observations[:index] for index in range(len(observations))]


def token_advantages(trajectory: Trajectory, turns: list[float], outcome_advantage: float) -> list[list[float]]:
    """Per segment, each response token's advantage: its turn's. A turn owns its num_tokens sampled tokens, in order
    over the segments, and the observation tokens after them (trained only with algo.mask_observations false); tokens
    past the last turn's count belong to it. A trajectory without turns keeps its outcome advantage."""
    if not turns:
        return [[outcome_advantage] * len(segment.loss_mask) for segment in trajectory.segments]
    ends = list(itertools.accumulate(turn.num_tokens for turn in trajectory.turns))
    turn, sampled, per_segment = 0, 0, []
    for segment in trajectory.segments:
        row = []
        for sampled_token in segment.loss_mask:
            if sampled_token:
                while turn < len(ends) - 1 and sampled >= ends[turn]:
                    turn += 1
                sampled += 1
            row.append(turns[turn])
        per_segment.append(row)
    return per_segment


def token_series_of(trajectories: list[Trajectory], samples: list[TrainSample]) -> dict[int, dict[str, list]]:
    """Per trajectory (by id), what the step computed per token of each of its segments, from `samples` as
    `train_samples` made them for `trajectories`: "actor_logprobs" (where the update computed them: not in one
    on-policy update) and "critic_values" (algo.advantage=gae)."""
    series = {"actor_logprobs": "old_logprobs", "critic_values": "old_values"}
    kept = {name: field for name, field in series.items() if samples and getattr(samples[0], field) is not None}
    if not kept:
        return {}
    remaining = iter(samples)
    found = {}
    for trajectory in (t for t in trajectories if not t.failed):
        own = [next(remaining) for _ in trajectory.segments]
        found[id(trajectory)] = {name: [getattr(sample, field) for sample in own] for name, field in kept.items()}
    return found


def overlong_masked(trajectories: list[Trajectory], algo: AlgoConfig) -> int:
    """Trajectories that train no token because of algo.overlong=mask."""
    return sum(is_overlong(t, algo) for t in trajectories if not t.failed) if algo.overlong == "mask" else 0


def minibatches(samples: list[TrainSample], algo: AlgoConfig, loss_agg: str | None = None) -> list[list[TrainSample]]:
    """The step's samples in algo.num_minibatches contiguous parts (see `rlsearch.algo.minibatch_bounds`), each
    with loss-aggregation weights (`loss_agg`, default algo.loss_agg) over its own tokens: every update's loss is a
    mean over what it trains on."""
    parts = [samples[start:end] for start, end in minibatch_bounds(len(samples), algo.num_minibatches)]
    return [
        [replace(sample, token_weights=w) for sample, w in zip(part, loss_token_weights(
            [sample.loss_mask for sample in part], loss_agg or algo.loss_agg))]
        for part in parts
    ]
