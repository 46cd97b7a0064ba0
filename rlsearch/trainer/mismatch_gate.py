"""The engine-vs-actor mismatch gate (algo.mismatch_threshold, algo.mismatch_action): after a step's update, a
mismatch above the threshold warns or stops the run, naming the step and the figure, as NeMo-RL's checks do."""

from __future__ import annotations

from collections.abc import Mapping

# the mean over trained tokens of |log pi_old - log pi_rollout| (actor group metrics, averaged over the updates)
MISMATCH_METRIC = "rollout/actor_logprob_diff_mean"


class RolloutMismatchError(RuntimeError):
    """A step's engine-vs-actor mismatch passed algo.mismatch_threshold with algo.mismatch_action=stop."""


def check_rollout_mismatch(step: int, metrics: Mapping[str, float], threshold: float, action: str) -> str | None:
    """None when the check is off (threshold 0) or the step's mismatch is within it; else the warning line
    (action warn), or RolloutMismatchError (action stop)."""
    value = metrics[MISMATCH_METRIC]
    if not threshold or value <= threshold:
        return None
    what = (f"step {step}: the engine and the actor disagree on the sampled tokens: {MISMATCH_METRIC} "
            f"(mean |log pi_old - log pi_rollout| per trained token) is {value:.4g}, above "
            f"algo.mismatch_threshold={threshold:g}")
    if action == "warn":
        return f"warning: {what}"
    raise RolloutMismatchError(
        f"{what}; the run stopped before the step's weights reached the engines. The engines sample closest to the "
        "actor with model.dtype=float32 and rollout.async_steps=0; or raise algo.mismatch_threshold, or set "
        "algo.mismatch_action=warn to go on")
