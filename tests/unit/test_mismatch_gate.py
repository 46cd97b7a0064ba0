"""The engine-vs-actor mismatch gate (algo.mismatch_threshold, algo.mismatch_action): off, within, warn and stop."""

from __future__ import annotations

import pytest

from rlsearch.trainer import RolloutMismatchError
from rlsearch.trainer.mismatch_gate import check_rollout_mismatch

METRICS = {"rollout/actor_logprob_diff_mean": 0.0125, "actor/grad_norm": 1.0}


def test_the_gate_is_off_at_threshold_zero_and_quiet_within_it():
    assert check_rollout_mismatch(3, METRICS, 0.0, "stop") is None
    assert check_rollout_mismatch(3, METRICS, 0.0125, "stop") is None  # at the threshold is within it
    assert check_rollout_mismatch(3, METRICS, 0.02, "stop") is None


def test_a_mismatch_above_the_threshold_warns_naming_the_step_and_the_figure():
    line = check_rollout_mismatch(3, METRICS, 0.01, "warn")
    assert line == ("warning: step 3: the engine and the actor disagree on the sampled tokens: "
                    "rollout/actor_logprob_diff_mean (mean |log pi_old - log pi_rollout| per trained token) is 0.0125, "
                    "above algo.mismatch_threshold=0.01")


def test_a_mismatch_above_the_threshold_stops_the_run_with_stop():
    with pytest.raises(RolloutMismatchError, match=r"^step 7: .* is 0\.0125, above algo\.mismatch_threshold=0\.01; "
                                                   r"the run stopped before the step's weights reached the engines"):
        check_rollout_mismatch(7, METRICS, 0.01, "stop")
