"""The probe check: after a sync every engine scores a fixed sequence, and must agree with the actor."""

from __future__ import annotations

import math
from collections.abc import Sequence

import ray


def check_engines_match_actor(actor_group, engines: Sequence, probe_ids: list[int], limit: float,
                              step: int) -> dict[str, float]:
    """Every engine and the actor score `probe_ids`; raise when any engine disagrees by more than `limit` (0: never
    on the size of the gap) or any side has NaN/inf logprobs. Returns the worst engine's max and the mean gap."""
    from ..actor import TrainSample

    scored = ray.get([engine.score.remote(probe_ids) for engine in engines])
    probe = TrainSample(probe_ids, response_start=1, loss_mask=[1] * (len(probe_ids) - 1))
    actor_logprobs = actor_group.compute_logprobs([probe], temperature=1.0)[0]
    worst_max, means = 0.0, []
    for index, engine_logprobs in enumerate(scored):
        nonfinite = nonfinite_logprobs(engine_logprobs, actor_logprobs)
        if nonfinite:  # whatever the limit says: NaN/inf weights are never a tolerable mismatch
            raise RuntimeError(
                f"NaN/inf logprobs on the probe sequence after step {step} (engine {index}; {nonfinite}): the weights "
                "hold NaN or inf values; stopping before training on or sampling from them."
            )
        worst, mean = logprob_mismatch(engine_logprobs, actor_logprobs)
        if limit and not worst <= limit:
            raise RuntimeError(
                f"rollout engine {index} and the actor disagree on the probe sequence after step {step}: max |logprob "
                f"diff| {worst:.3e} > bridge.max_logprob_mismatch={limit:g}. The engine is running different weights "
                "than the actor (a broken weight sync); stopping before training on stale samples."
            )
        worst_max = max(worst_max, worst)
        means.append(mean)
    return {"bridge/logprob_mismatch_max": worst_max, "bridge/logprob_mismatch_mean": sum(means) / len(means)}


def logprob_mismatch(engine_logprobs: Sequence[float], actor_logprobs: Sequence[float]) -> tuple[float, float]:
    """(max, mean) absolute difference between two per-token logprob lists of the same sequence; both NaN when any
    logprob is NaN or infinite (so a `mismatch < limit` check fails, and `max` cannot skip a NaN)."""
    if len(engine_logprobs) != len(actor_logprobs) or not engine_logprobs:
        raise ValueError(f"cannot compare {len(engine_logprobs)} engine and {len(actor_logprobs)} actor logprobs")
    if nonfinite_logprobs(engine_logprobs, actor_logprobs):
        return math.nan, math.nan
    diffs = [abs(a - b) for a, b in zip(engine_logprobs, actor_logprobs)]
    return max(diffs), sum(diffs) / len(diffs)


def nonfinite_logprobs(engine_logprobs: Sequence[float], actor_logprobs: Sequence[float]) -> str:
    """Which side has NaN/inf logprobs and at how many positions, e.g. 'actor: 11 of 11 positions NaN/inf';
    empty when all are finite."""
    parts = []
    for side, values in (("engine", engine_logprobs), ("actor", actor_logprobs)):
        bad = [index for index, value in enumerate(values) if not math.isfinite(value)]
        if bad:
            parts.append(f"{side}: {len(bad)} of {len(values)} positions NaN/inf (first at position {bad[0]}: "
                         f"{values[bad[0]]})")
    return "; ".join(parts)
