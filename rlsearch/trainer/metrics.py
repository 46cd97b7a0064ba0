"""Step metrics computed from trajectories (plain data): rewards, turns, tool use, errors, lengths."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from ..config import TRUNCATION_REASONS
from ..rollout import Trajectory
from ..tools import ErrorKind


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def trajectory_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    rewards = [t.reward for t in trajectories if not t.failed]  # a failed one has no reward, only a reason
    tool_calls = [t.tool_calls for t in trajectories]
    metrics = {
        "rollout/trajectories": float(len(trajectories)),
        "reward/mean": _mean(rewards),
        "reward/std": float(statistics.pstdev(rewards)) if len(rewards) > 1 else 0.0,
        "reward/em": _mean([t.scores.get("em", 0.0) for t in trajectories]),
        "reward/f1": _mean([t.scores.get("f1", 0.0) for t in trajectories]),
        "reward/answer_rate": _mean([t.scores.get("has_answer", 0.0) for t in trajectories]),
        # called a tool, no invalid call (the reward.search_score term)
        "reward/valid_search_rate": _mean([t.scores.get("valid_search", 0.0) for t in trajectories]),
        "rollout/response_len_mean": _mean([len(t.response_ids) for t in trajectories]),
        "rollout/model_tokens_mean": _mean([sum(t.loss_mask) for t in trajectories]),
        "rollout/turns_mean": _mean([len(t.turns) for t in trajectories]),
        "rollout/tool_calls_mean": _mean([len(calls) for calls in tool_calls]),
        "rollout/tool_errors": float(sum(not call.ok and call.error_kind != ErrorKind.NOT_RUN.value
                                         for calls in tool_calls for call in calls)),
        "rollout/invalid_calls_mean": _mean([t.num_invalid_calls for t in trajectories]),
        # where a trajectory's rollout time went: waiting on the engine vs on its tool calls
        "time/generate_s_mean": _mean([t.generate_s for t in trajectories]),
        "time/tool_wait_s_mean": _mean([t.tool_s for t in trajectories]),
        # trajectories a weight update landed on while they generated (rollout.update_weights_in_flight)
        "rollout/mixed_policy_fraction": _mean([len(t.weight_versions) > 1 for t in trajectories]),
        # trajectories left out of training (a user agent or the reward judge failed), segments per trajectory
        "rollout/failed_trajectories": float(sum(bool(t.failed) for t in trajectories)),
        "rollout/segments_mean": _mean([len(t.segments) for t in trajectories]),
    }
    for reason in ("answer", "eos", "length", "max_turns", "context"):
        metrics[f"rollout/finish_{reason}"] = _mean([t.finish_reason == reason for t in trajectories])
    # every cut over the step, by reason (rlsearch.config.TRUNCATION_REASONS)
    cuts = Counter(reason for t in trajectories for reason in t.truncations)
    for reason in TRUNCATION_REASONS:
        metrics[f"rollout/truncated/{reason}"] = float(cuts[reason])
    # of the context tokens a trajectory had already sent to or received from its engine, the share the engine's
    # prefix cache still held when the next turn was requested (1.0: nothing computed twice but the block remainder)
    turns = [turn for t in trajectories for turn in t.turns if turn.cache_ceiling]
    if turns:
        hits = sum(min(turn.cached_tokens, turn.cache_ceiling) for turn in turns)
        metrics["rollout/prefix_cache_hit_rate"] = hits / sum(turn.cache_ceiling for turn in turns)
    # totals over the step: calls that reached each tool, and error observations of each kind
    per_tool = Counter(call.name for t in trajectories for call in t.dispatched_calls)
    for name, count in sorted(per_tool.items()):
        metrics[f"rollout/tool_calls/{name}"] = float(count)
    # every call's error, and every invalid call's (its turn holds no calls)
    per_kind = Counter(call.error_kind for t in trajectories for call in t.tool_calls if call.error_kind)
    turns_without_calls = [turn for t in trajectories for turn in t.turns if not turn.tool_calls]
    per_kind.update(turn.error_kind for turn in turns_without_calls if turn.error_kind)
    for kind in ErrorKind:
        metrics[f"rollout/errors/{kind.value}"] = float(per_kind[kind.value])
    return metrics


def token_staleness(trajectories: Sequence[Trajectory], trained_version: int) -> list[int]:
    """Per sampled token of a turn, how many weight updates the policy being trained is ahead of the version that
    sampled it (a turn an update landed on counts with its older version)."""
    return [
        trained_version - min(turn.weight_versions)
        for t in trajectories for turn in t.turns if turn.weight_versions
        for _ in range(turn.num_tokens)
    ]


def staleness_metrics(staleness: Sequence[int]) -> dict[str, float]:
    """Token staleness summarised: mean, max and the share of tokens 0, 1, 2 and 3 or more updates old."""
    if not staleness:
        return {}
    counts = Counter(min(value, 3) for value in staleness)
    return {
        "rollout/token_staleness_mean": _mean(staleness),
        "rollout/token_staleness_max": float(max(staleness)),
        **{f"rollout/token_staleness/{label}": counts[value] / len(staleness)
           for value, label in ((0, "0"), (1, "1"), (2, "2"), (3, "3+"))},
    }
