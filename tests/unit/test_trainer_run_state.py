"""The trainer's run state and step log without Ray: `RunProgress.rewind` (a resume, and dead actor ranks rewinding
the run), which steps print a progress line, the run's counters in a step's metrics, and a trajectory record
(trainer/progress.py, trainer/step_log.py)."""

from __future__ import annotations

from rlsearch.data import QAExample
from rlsearch.trainer.progress import RunProgress
from rlsearch.trainer.rollouts import PendingRollout
from rlsearch.trainer.sampler import EpochSampler, SamplerState
from rlsearch.trainer.skip_guard import SkipGuard
from rlsearch.trainer.step_log import prints_step, run_metrics, trajectory_record
from rlsearch.trainer.update import PolicyUpdate
from rlsearch.trajectory import Segment, Trajectory


def test_a_rewind_sets_the_step_the_data_position_and_a_fresh_skip_guard() -> None:
    sampler = EpochSampler(list(range(10)), seed=3)
    progress = RunProgress(step=7, next_rollout_step=9, sampler=sampler, skip_guard=SkipGuard(3))
    for step in (5, 6, 7):  # two skipped in a row since step 5
        progress.skip_guard.record(step, skipped=step > 5)
    first = sampler.next_batch(4)
    sampler.next_batch(8)  # into epoch 1
    progress.rewind(4, SamplerState(epoch=0, position=0))
    assert (progress.step, progress.next_rollout_step) == (4, 5)
    assert progress.trained_sampler_state == progress.good_sampler_state == SamplerState(0, 0)
    assert sampler.next_batch(4) == first  # the same prompts again, in the same order
    guard = progress.skip_guard
    assert (guard.max_consecutive, guard.last_good_step, guard.total, guard.consecutive) == (3, 4, 0, [])


def test_a_rewind_without_a_sampler_keeps_the_counters() -> None:
    progress = RunProgress(step=3, engine_restarts=2, actor_restarts=1, weight_version=5)
    progress.rewind(0, SamplerState())
    assert (progress.step, progress.next_rollout_step, progress.skip_guard.last_good_step) == (0, 1, 0)
    assert (progress.engine_restarts, progress.actor_restarts, progress.weight_version) == (2, 1, 5)


def test_the_first_the_last_and_every_intervals_step_print_a_line() -> None:
    assert [step for step in range(1, 21) if prints_step(step, 20, 0)] == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert [step for step in range(1, 8) if prints_step(step, 7, 3)] == [1, 3, 6, 7]
    assert [step for step in range(1, 4) if prints_step(step, 3, 0)] == [1, 2, 3]  # a tenth of 3 steps rounds up


class Pool:
    def tool_stats(self) -> dict[str, int]:
        return {"failures": 2, "calls_out": 5}

    def last_metrics(self, step: int) -> dict[str, float]:
        return {"rollout/engine_queue": float(step)}

    def idle_seconds(self) -> float:
        return 1.5


def test_the_run_counters_count_this_steps_skip_and_the_restarts() -> None:
    progress = RunProgress(engine_restarts=3, actor_restarts=1, skip_guard=SkipGuard(3, total=2))
    skipped = PolicyUpdate({}, [{"actor/skipped_nonfinite": 1.0}])
    metrics = run_metrics(Pool(), progress, step=4, update=skipped, staleness=1)
    assert metrics == {
        "rollout/engine_queue": 4.0, "actor/skipped_steps_total": 3.0, "rollout/tool_failures_total": 2.0,
        "rollout/tool_calls_out_total": 5.0, "rollout/paid_calls_out_total": 0.0, "rollout/tool_failovers_total": 0.0,
        "rollout/summariser_calls_total": 0.0, "rollout/engine_restarts_total": 3.0, "actor/restarts_total": 1.0,
        "rollout/staleness": 1.0, "time/engine_idle_s": 1.5,
    }
    applied = PolicyUpdate({}, [{"actor/skipped_nonfinite": 0.0}])
    assert run_metrics(Pool(), progress, 4, applied, 0)["actor/skipped_steps_total"] == 2.0
    assert run_metrics(Pool(), progress, 4, None, 0)["actor/skipped_steps_total"] == 2.0  # no update at all


def test_a_trajectory_record_names_its_question_staleness_and_the_actors_logprobs() -> None:
    example = QAExample(id="q1", question="Who founded Velmora?", golden_answers=("Ada Brun",), data_source="toy")
    rollout = PendingRollout(step=3, examples=[example], trajectories=None, items=[], weight_version=2,
                             sampler=SamplerState())
    trajectory = Trajectory("q1", group_id=0, sample_index=1, prompt_ids=[1, 2], response_ids=[3], loss_mask=[1],
                            rollout_logprobs=[-0.5], weight_versions=[1, 2],
                            earlier_segments=[Segment([1], [2], [1], [-0.25])])
    record = trajectory_record(trajectory, rollout, step=3, token_series={
        "actor_logprobs": [[-0.3], [-0.6]], "critic_values": [[0.25], [0.5]]}, trained_version=2)
    assert (record["step"], record["question"], record["golden_answers"]) == (3, "Who founded Velmora?", ["Ada Brun"])
    assert record["staleness"] == 1  # its oldest turn was sampled one version behind the trained policy
    assert record["actor_logprobs"] == [-0.6] and record["earlier_segments"][0]["actor_logprobs"] == [-0.3]
    assert record["critic_values"] == [0.5] and record["earlier_segments"][0]["critic_values"] == [0.25]
    # no weight versions recorded: the version the rollout was submitted under; no logprobs computed: none recorded
    trajectory.weight_versions = []
    record = trajectory_record(trajectory, rollout, step=3, token_series={}, trained_version=2)
    assert record["staleness"] == 0 and "actor_logprobs" not in record and "critic_values" not in record
