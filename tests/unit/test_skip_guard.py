"""Steps skipped for a NaN/inf loss or grad norm: counting, the stop after trainer.max_consecutive_skips with a
checkpoint of the last good step, and probe logprobs that are not finite."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from rlsearch.config import ConfigError, load_train_config
from rlsearch.trainer import SamplerState
from rlsearch.trainer.actor_side import ActorSide
from rlsearch.trainer.progress import RunProgress
from rlsearch.trainer.skip_guard import NonFiniteStepsError, SkipGuard
from rlsearch.weights import check_engines_match_actor, logprob_mismatch, nonfinite_logprobs


def test_guard_counts_skips_and_stops_at_the_kth_in_a_row() -> None:
    guard = SkipGuard(max_consecutive=3)
    for step, skipped in [(1, False), (2, True), (3, True), (4, False), (5, True), (6, True)]:
        guard.record(step, skipped)
    assert (guard.total, guard.consecutive, guard.last_good_step) == (4, [5, 6], 4)
    with pytest.raises(NonFiniteStepsError) as error:
        guard.record(7, True)
    assert (error.value.steps, error.value.last_good_step, guard.total) == ([5, 6, 7], 4, 5)
    message = str(error.value)
    assert "NaN/inf in 3 consecutive steps (5, 6, 7)" in message
    assert "trainer.max_consecutive_skips=3" in message and "not updated since step 4" in message


def test_guard_with_zero_never_stops() -> None:
    guard = SkipGuard(max_consecutive=0)
    for step in range(1, 101):
        guard.record(step, True)
    assert guard.total == 100 and len(guard.consecutive) == 100 and guard.last_good_step == 0


def test_stop_message_names_the_checkpoint_or_the_initial_model() -> None:
    error = NonFiniteStepsError([8, 9], last_good_step=7, limit=2)
    error.checkpoint = Path("/run/checkpoints/step_000007")
    message = str(error)
    assert "weights were not updated since step 7. Checkpoint of step 7" in message
    assert "from before step 8): /run/checkpoints/step_000007" in message
    assert "trainer.resume=/run/checkpoints/step_000007" in message
    fresh = NonFiniteStepsError([1, 2], last_good_step=0, limit=2)
    fresh.initial_model = "outputs/assets/tiny-qwen2"
    assert "since the run started (step 0)" in str(fresh)
    assert "no checkpoint was saved: they are those of model.path=outputs/assets/tiny-qwen2" in str(fresh)


def _trainer(limit: int, saved: list) -> ActorSide:
    """The trainer's skip bookkeeping (trainer/actor_side.py) alone: no engines, actor or data."""
    config = load_train_config(None, [f"trainer.max_consecutive_skips={limit}"])
    # the steps that are not skipped below update the weights
    progress = RunProgress(weights_updated=True, skip_guard=SkipGuard(limit))
    trainer = ActorSide(config, parts=None, progress=progress, rollout_side=None)

    def save_checkpoint(step: int, sampler: SamplerState) -> Path:
        saved.append((step, sampler))
        return Path(f"/run/checkpoints/step_{step:06d}")

    trainer.save_checkpoint = save_checkpoint
    return trainer


def _run(trainer: ActorSide, outcomes: list[bool]) -> None:
    for step, skipped in enumerate(outcomes, start=1):
        trainer.progress.step = step
        # the data after this step's batch
        trainer.progress.trained_sampler_state = SamplerState(epoch=0, position=4 * step)
        trainer.record_skip({"actor/skipped_nonfinite": float(skipped), "actor/policy_loss": math.nan})


def test_trainer_saves_the_last_good_step_with_its_data_position_and_stops(capsys) -> None:
    saved: list = []
    trainer = _trainer(2, saved)
    with pytest.raises(NonFiniteStepsError) as error:
        _run(trainer, [False, False, True, False, True, True, False])
    # the checkpoint is step 4's, with the sampler after step 4's batch (the skipped batches are drawn again)
    assert saved == [(4, SamplerState(epoch=0, position=16))]
    assert error.value.checkpoint == Path("/run/checkpoints/step_000004") and error.value.steps == [5, 6]
    assert "not updated since step 4" in str(error.value) and "step_000004" in str(error.value)
    assert "step 6: loss nan, NaN/inf in the loss or gradients: optimizer step skipped" in capsys.readouterr().out


def test_trainer_reuses_its_checkpoint_of_the_last_good_step(tmp_path: Path) -> None:
    saved: list = []
    trainer = _trainer(1, saved)
    trainer.progress.saved_checkpoints[1] = tmp_path  # saved by save_interval after step 1
    with pytest.raises(NonFiniteStepsError) as error:
        _run(trainer, [False, True])
    assert saved == [] and error.value.checkpoint == tmp_path


def test_trainer_that_never_updated_names_the_initial_model() -> None:
    saved: list = []
    trainer = _trainer(2, saved)
    with pytest.raises(NonFiniteStepsError) as error:
        _run(trainer, [True, True])
    assert saved == [] and error.value.checkpoint is None
    assert error.value.initial_model == trainer.config.model.path


def test_max_consecutive_skips_config() -> None:
    assert load_train_config(None, []).trainer.max_consecutive_skips == 3
    assert load_train_config(None, ["trainer.max_consecutive_skips=0"]).trainer.max_consecutive_skips == 0
    with pytest.raises(ConfigError, match=r"'trainer\.max_consecutive_skips' must be >= 0"):
        load_train_config(None, ["trainer.max_consecutive_skips=-1"])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_probe_logprobs_never_pass_a_mismatch_limit(bad: float) -> None:
    engine = [-1.0, -2.0, -0.5]
    actor = [bad, -2.0, -0.5]  # Python's max() would skip a leading NaN: max([nan, 0.0]) is nan but not max([0, nan])
    worst, mean = logprob_mismatch(engine, actor)
    assert math.isnan(worst) and math.isnan(mean) and not worst <= 1e-4
    worst, _ = logprob_mismatch(list(reversed(engine)), list(reversed(actor)))
    assert math.isnan(worst)
    assert nonfinite_logprobs(engine, actor) == f"actor: 1 of 3 positions NaN/inf (first at position 0: {bad})"
    assert nonfinite_logprobs(engine, engine) == ""
    assert logprob_mismatch(engine, [-1.0, -2.0, -0.75]) == (0.25, pytest.approx(0.25 / 3))


def _check(engines: list[list[float]], actor: list[float], limit: float, monkeypatch) -> dict[str, float]:
    """The probe check with stand-ins for the engines and the actor (and ray.get passing values through)."""
    import ray

    monkeypatch.setattr(ray, "get", lambda value: value)
    sampled = list(range(100, 100 + len(actor)))
    handles = [
        type("Engine", (), {"sample_probe": type("Call", (), {
            "remote": staticmethod(lambda prompt, num_tokens, seed, lp=lp: (sampled, lp))
        })})
        for lp in engines
    ]
    actor_ranks = type("Actor", (), {
        "score_continuations": lambda self, prompt, continuations: [actor for _ in continuations]
    })()
    return check_engines_match_actor(actor_ranks, handles, [1, 2, 3], limit, step=5)


@pytest.mark.parametrize("limit", [1e-4, 0.0], ids=["limit", "limit-disabled"])
def test_parity_check_fails_on_nan_probe_logprobs(limit: float, monkeypatch) -> None:
    engine = [-1.0, -2.0, -0.5]
    with pytest.raises(RuntimeError, match=re.escape(
        "NaN/inf logprobs on the probe sequence after step 5 (engine 0; actor: 1 of 3 positions NaN/inf (first at "
        "position 1: nan)): the weights hold NaN or inf values"
    )):
        _check([engine], [-1.0, math.nan, -0.5], limit, monkeypatch)
    ok = _check([engine, [-1.0, -2.0, -0.5001]], [-1.0, -2.0, -0.50005], limit, monkeypatch)
    assert ok["weights/logprob_mismatch_max"] == pytest.approx(5e-5)
    assert ok["weights/logprob_mismatch_mean"] == pytest.approx(5e-5 / 3)
    if limit:  # every engine is checked, not just the first
        with pytest.raises(RuntimeError, match="rollout engine 1 and the actor disagree on the probe sequence after "
                                               "step 5"):
            _check([engine, [-1.0, -2.0, -0.6]], engine, limit, monkeypatch)
