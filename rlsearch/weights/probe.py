"""The probe check: after a sync every engine samples a few tokens after a fixed prompt at the rollout's own
distribution (temperature, logit bias), and the actor must give them the logprobs the engine reported."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

PROBE_TOKENS = 16  # sampled after the probe prompt by each engine
PROBE_SEED = 20_260_525  # the same draw on every engine and after every sync
# weights.max_logprob_mismatch's default: above the engine-vs-actor gaps that numerics give, far below those of weights
# one update stale. Measured on CPU (docs/reliability.md, "The probe check"): numerics up to 6e-4 in float32 and 3.8e-2
# in bfloat16 (the SFT-warm-started tiny Qwen2, temperatures 0.3-1.3), one stale update 0.54 and more
MISMATCH_BY_DTYPE = {"float32": 2e-3, "bfloat16": 1e-1}


def default_mismatch_limit(dtype: str) -> float:
    """weights.max_logprob_mismatch's default for `model.dtype`."""
    return MISMATCH_BY_DTYPE[dtype]


class ContinuationScorer(Protocol):
    """The actor side of the probe check (rlsearch.actor.ActorRanks is one)."""

    def score_continuations(self, prompt: list[int], continuations: Sequence[list[int]]) -> list[list[float]]:
        ...


def check_engines_match_actor(actor_ranks: ContinuationScorer, engines: Sequence, probe_prompt: list[int],
                              limit: float, step: int) -> dict[str, float]:
    """Every engine samples PROBE_TOKENS tokens after `probe_prompt` at the rollout's distribution, and the actor
    scores each engine's tokens under that same distribution; raise when any engine disagrees by more than `limit`
    (0: never on the size of the gap) or any side has NaN/inf logprobs. Returns the worst engine's max and the mean
    gap."""
    import ray

    sampled = ray.get([engine.sample_probe.remote(probe_prompt, PROBE_TOKENS, PROBE_SEED) for engine in engines])
    actor_scored = actor_ranks.score_continuations(probe_prompt, [token_ids for token_ids, _ in sampled])
    worst_max, means = 0.0, []
    for index, ((_, engine_logprobs), actor_logprobs) in enumerate(zip(sampled, actor_scored)):
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
                f"diff| {worst:.3e} > weights.max_logprob_mismatch={limit:g}. Either the engine runs other weights "
                "than the actor (a broken weight sync) or it samples from another distribution than the actor scores "
                "(temperature, logit bias); stopping before training on such samples."
            )
        worst_max = max(worst_max, worst)
        means.append(mean)
    return {"weights/logprob_mismatch_max": worst_max, "weights/logprob_mismatch_mean": sum(means) / len(means)}


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
