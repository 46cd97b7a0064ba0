"""RunLogger's TensorBoard log when a training run logs into a dir an earlier run (or the same run before a rewind)
logged into: each step shows once, with the values of the run that trained it last; an eval's scalars added to a
run's log drop nothing."""

from __future__ import annotations

from pathlib import Path

from rlsearch.runlog import RunLogger


def _log(run_dir: Path, resumed_step: int | None, rewards: dict[int, float]) -> None:
    logger = RunLogger(run_dir, log_trajectories=False, resumed_step=resumed_step)
    for step, reward in rewards.items():
        logger.log_metrics(step, {"reward/mean": reward})
    logger.close()


def _shown(run_dir: Path, tag: str = "reward/mean") -> list[tuple[int, float]]:
    """What TensorBoard shows: every point of the tag, in the order read, duplicates kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_a_run_rewound_to_the_start_shows_each_step_once(tmp_path: Path) -> None:
    """Actor ranks that die before the first checkpoint rewind the run to step 0 (ActorSide.replace_dead_ranks),
    as a supervised driver restarted before it starts over: steps 1 and 2 are trained again."""
    _log(tmp_path, resumed_step=0, rewards={1: 0.25})  # step 2 died
    _log(tmp_path, resumed_step=0, rewards={1: 0.5, 2: 0.75})
    assert _shown(tmp_path) == [(1, 0.5), (2, 0.75)]


def test_a_resumed_run_keeps_the_checkpointed_steps_and_replaces_the_later_ones(tmp_path: Path) -> None:
    _log(tmp_path, resumed_step=0, rewards={1: 0.25, 2: 0.5, 3: 0.125})  # checkpointed after step 2
    _log(tmp_path, resumed_step=2, rewards={3: 0.75, 4: 1.0})
    assert _shown(tmp_path) == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]


def test_an_eval_added_to_a_runs_log_drops_none_of_its_steps(tmp_path: Path) -> None:
    """`rlsearch eval` with eval.log_dir: the checkpoint's scores at its step, beside the run's."""
    _log(tmp_path, resumed_step=0, rewards={1: 0.25, 2: 0.5})
    logger = RunLogger(tmp_path, log_trajectories=False)
    logger.log_metrics(2, {"eval/overall/em": 0.375})
    logger.close()
    assert _shown(tmp_path) == [(1, 0.25), (2, 0.5)]
    assert _shown(tmp_path, "eval/overall/em") == [(2, 0.375)]


def test_a_logger_opened_in_the_second_of_an_earlier_event_file_is_read_after_it(tmp_path: Path) -> None:
    """The earlier file named as a writer of another host or a later counter would name it in this second: one that
    sorts after every name of the second unless the logger waits for the next."""
    import time

    earlier = tmp_path / "tensorboard" / f"events.out.tfevents.{int(time.time()):010d}.zzzz.99999.99"
    earlier.parent.mkdir()
    earlier.touch()
    logger = RunLogger(tmp_path, log_trajectories=False, resumed_step=0)
    logger.close()
    names = sorted(path.name for path in earlier.parent.iterdir())
    assert len(names) == 2 and names[0] == earlier.name


def test_an_event_file_stamped_in_the_future_is_waited_for_briefly_then_named(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    """A run dir copied from a host whose clock is an hour ahead (or a clock stepped back): start-up waits at most
    EVENT_FILE_WAIT_LIMIT_S, not the hour, and says why the dir's scalars may show twice."""
    from types import SimpleNamespace

    from rlsearch.runlog import writer

    now = 1_700_000_000.0
    future = tmp_path / "tensorboard" / f"events.out.tfevents.{int(now) + 3600:010d}.otherhost.1.0"
    future.parent.mkdir()
    future.touch()
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        assert sum(slept) <= writer.EVENT_FILE_WAIT_LIMIT_S, "waited for the skew, not the limit"

    monkeypatch.setattr(writer, "time", SimpleNamespace(time=lambda: now + sum(slept), sleep=sleep))
    logger = RunLogger(tmp_path, log_trajectories=False, resumed_step=0)
    logger.close()
    printed = capsys.readouterr().out
    assert f"holds an event file stamped 3601 s in the future ({future.name}: clock skew" in printed
    assert "move it out of the dir" in printed
