"""The trainer's recovery decisions (trainer/recovery.py) without Ray: a rollout on which every engine died, an
engine found dead around a sync, dead actor ranks, an error that is no worker's death, the stop's message; and the
choice of the checkpoint a run resumes (trainer/checkpoints.py) on a store in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsearch.checkpoint import CheckpointStore
from rlsearch.config import ConfigError, TrainConfig, load_train_config, to_dict
from rlsearch.trainer.checkpoints import ResumePoint, checkpoint_to_resume, newest_own_checkpoint
from rlsearch.trainer.recovery import Action, RestartPolicy, Verdict, died_message, is_ray_error
from rlsearch.trainer.sampler import SamplerState

RANKS = {"actor rank 0 (tp 0, pp 0, cp 0, dp 0)", "actor rank 1 (tp 0, pp 0, cp 0, dp 1)"}
RANK_0 = "actor rank 0 (tp 0, pp 0, cp 0, dp 0)"


def test_a_rollout_on_which_every_engine_died_runs_again_up_to_the_engine_restarts_of_a_step() -> None:
    policy = RestartPolicy(engine_restarts_per_step=2, actor_restarts=3)
    assert [policy.rollout_lost_every_engine(failures).action for failures in (1, 2, 3)] == [
        Action.REPLACE, Action.REPLACE, Action.RERAISE]
    # none allowed: the first loss goes on as NoEngineLeftError, which the trainer's stop names the dead engines for
    assert RestartPolicy(0, 3).rollout_lost_every_engine(1) == Verdict(Action.RERAISE)


def test_an_engine_dead_at_a_sync_is_replaced_within_the_steps_restarts_else_the_run_stops() -> None:
    policy = RestartPolicy(engine_restarts_per_step=2, actor_restarts=3)
    assert policy.engines_died(dead=1, restarts_in_step=0) == Verdict(Action.REPLACE)
    assert policy.engines_died(dead=2, restarts_in_step=0) == Verdict(Action.REPLACE)
    assert policy.engines_died(dead=1, restarts_in_step=2) == Verdict(
        Action.STOP, " (after 2 engine restart(s) in this step: rollout.max_engine_restarts_per_step=2)")
    assert policy.engines_died(dead=2, restarts_in_step=1).action is Action.STOP  # 3 in the step: past the limit
    assert RestartPolicy(0, 3).engines_died(1, 0).limit_note == (
        " (after 0 engine restart(s) in this step: rollout.max_engine_restarts_per_step=0)")


def test_a_failed_sync_with_every_engine_alive_is_reraised() -> None:
    assert RestartPolicy(2, 3).engines_died(dead=0, restarts_in_step=0) == Verdict(Action.RERAISE)
    assert RestartPolicy(2, 3).engines_died(dead=0, restarts_in_step=5) == Verdict(Action.RERAISE)


def test_a_sync_runs_again_once_after_its_dead_engine_was_replaced() -> None:
    """The trainer acting on the verdict: the sync that failed runs once more on the replacement; a second failure
    stops the run with the sync's own error."""
    from rlsearch.trainer.progress import RunParts, RunProgress
    from rlsearch.trainer.rollout_side import RolloutSide
    from rlsearch.weights import WeightSyncError

    class Pool:
        def __init__(self) -> None:
            self.engines, self.dead, self.restarted = ["engine 0"], [], []

        def dead_engines(self) -> list[int]:
            return self.dead

        def restart(self, index: int) -> None:
            self.dead = []
            self.restarted.append(index)

    class FailingSync:
        """Every sync fails; engine 0 dies during the first."""

        def __init__(self, pool: Pool) -> None:
            self.pool, self.calls = pool, 0

        def sync(self, engines, version):
            self.calls += 1
            self.pool.dead = [0] if self.calls == 1 else []
            raise WeightSyncError(f"sync {self.calls} failed")

    pool = Pool()
    parts = RunParts(CheckpointStore("/nonexistent"), pool=pool, weight_sync=FailingSync(pool))
    trainer = RolloutSide(load_train_config(None, []), parts, RunProgress(step=1), rollouts=[])
    with pytest.raises(WeightSyncError, match="sync 2 failed"):
        trainer.sync_new_weights(changed=True, timings={})
    assert trainer.parts.weight_sync.calls == 2 and trainer.parts.pool.restarted == [0]
    assert trainer.progress.engine_restarts == 1 and trainer.progress.restarts_by_step == {1: 1}


def test_dead_actor_ranks_are_replaced_up_to_max_actor_restarts_then_the_run_stops() -> None:
    policy = RestartPolicy(engine_restarts_per_step=2, actor_restarts=2)
    assert [policy.step_failed(True, [RANK_0], RANKS, restarts).action for restarts in (0, 1)] == [
        Action.REPLACE, Action.REPLACE]
    assert policy.step_failed(True, [RANK_0], RANKS, restarts=2) == Verdict(
        Action.STOP, " (after 2 actor restart(s) in this run: trainer.max_actor_restarts=2)")
    assert policy.step_failed(True, sorted(RANKS), RANKS, restarts=0) == Verdict(Action.REPLACE)  # every rank
    # trainer.max_actor_restarts=0: the first dead rank stops the run, the message naming no limit
    assert RestartPolicy(2, 0).step_failed(True, [RANK_0], RANKS, restarts=0) == Verdict(Action.STOP, "")


def test_actor_ranks_are_not_replaced_when_an_engine_died_too() -> None:
    verdict = RestartPolicy(2, 3).step_failed(True, [RANK_0, "rollout engine 0"], RANKS, restarts=0)
    assert verdict == Verdict(Action.STOP, "")


def test_an_error_that_is_no_workers_death_is_reraised() -> None:
    policy = RestartPolicy(2, 3)
    assert policy.step_failed(False, [], RANKS, restarts=0) == Verdict(Action.RERAISE)  # not a Ray error
    assert policy.step_failed(False, [RANK_0], RANKS, restarts=0) == Verdict(Action.RERAISE)  # whatever else died
    assert policy.step_failed(True, [], RANKS, restarts=0) == Verdict(Action.RERAISE)  # a Ray error, nothing dead


def test_a_ray_error_is_told_through_the_errors_it_was_raised_from() -> None:
    import ray

    assert not is_ray_error(ValueError("a bad batch")) and not is_ray_error(None)
    try:
        try:
            raise ray.exceptions.RayError("the actor died")
        except ray.exceptions.RayError as cause:
            raise RuntimeError("the checkpoint failed") from cause
    except RuntimeError as error:
        assert is_ray_error(error)


def test_the_died_message_names_the_dead_how_and_the_way_on(tmp_path) -> None:
    checkpoint = tmp_path / "checkpoints" / "step_000002"
    assert died_message([RANK_0], 4, checkpoint, 2) == (
        f"{RANK_0} died (its process exited) during step 4; the run stopped. the last complete checkpoint is "
        f"{checkpoint}: run the same command again (trainer.resume=auto) to continue from it")
    killed = RuntimeError("The actor died. Worker exit type: SYSTEM_ERROR Worker exit detail: It was killed.")
    assert died_message(["rollout engine 0", "rollout engine 1"], 1, None, 5, killed) == (
        "rollout engine 0 and rollout engine 1 died (its process exited) during step 1 (Ray: SYSTEM_ERROR: It was "
        "killed.); the run stopped. no checkpoint was saved yet (trainer.save_interval=5)")


# ---- the checkpoint a run resumes ---------------------------------------------------------------------


def _save(store: CheckpointStore, step: int, seed: int, tmp_path, hf_config: str = '{"model_type": "qwen2"}') -> None:
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(hf_config)

    def write_model(directory: str) -> None:
        (Path(directory) / "__0_0.distcp").write_bytes(b"x")

    state = {"sampler": {"epoch": 0, "position": 4 * step}, "seed": seed, "config": to_dict(TrainConfig())}
    info = {"layout": {"tp": 1, "pp": 1, "dp": 1}, "architecture": "qwen2", "transformer_impl": "local"}
    store.save(step, write_model, state, hf, info)


def test_resume_auto_without_a_checkpoint_starts_fresh_and_with_one_resumes_the_newest(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "run")
    seed = load_train_config(None, []).trainer.seed
    config = load_train_config(None, ["trainer.resume=auto"])
    assert checkpoint_to_resume(config, store) is None
    _save(store, 2, seed, tmp_path)
    _save(store, 4, seed, tmp_path)
    assert checkpoint_to_resume(config, store) == ResumePoint(
        store.root / "step_000004", {"tp": 1, "pp": 1, "dp": 1}, 4, SamplerState(0, 16))
    assert checkpoint_to_resume(load_train_config(None, ["trainer.resume=none"]), CheckpointStore(tmp_path / "new")) \
        is None


def test_a_fresh_run_into_another_runs_dir_is_refused_before_anything_is_written(tmp_path, monkeypatch) -> None:
    from rlsearch.supervisor import ATTEMPT_VARIABLE

    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "trajectories" / "step_000001.jsonl").write_text("{}\n")
    before = sorted(path for path in run.rglob("*"))
    fresh = load_train_config(None, ["trainer.resume=none", f"trainer.output_dir={run}"])
    with pytest.raises(ConfigError) as refused:
        checkpoint_to_resume(fresh, CheckpointStore(run))
    assert str(refused.value) == (
        f"'trainer.output_dir' ({run}) holds another run: 1 trajectory file(s) (trajectories/step_000001.jsonl, ...). "
        "trainer.resume=none would overwrite its files step by step and leave the two runs mixed; give another "
        "trainer.output_dir, delete the dir, or continue that run with trainer.resume=auto")
    assert sorted(path for path in run.rglob("*")) == before
    _save(CheckpointStore(run), 2, fresh.trainer.seed, tmp_path)
    with pytest.raises(ConfigError, match=r"holds another run: 1 trajectory file\(s\) .* and 1 checkpoint\(s\) "
                                          r"\(checkpoints/step_000002, \.\.\.\)"):
        checkpoint_to_resume(fresh, CheckpointStore(run))
    monkeypatch.setenv(ATTEMPT_VARIABLE, "1")  # the supervisor's restart before the first checkpoint: its own run
    assert checkpoint_to_resume(fresh, CheckpointStore(run)) is None
    with pytest.raises(ConfigError, match=r"'trainer\.output_dir' must name a directory \(empty would write into "
                                          r"the current directory\); got ''"):
        load_train_config(None, ["trainer.output_dir="])


@pytest.mark.parametrize("override, refusal", [
    ("trainer.seed=7", "'trainer.seed' is 7 but the checkpoint {checkpoint} was trained with seed 11; a resumed run "
     "keeps its seed so the data order and sampling continue. Drop the override, or start a fresh run with "
     "trainer.resume=none"),
    ("actor.use_distributed_optimizer=true", "'actor.use_distributed_optimizer' is true but the checkpoint "
     "{checkpoint} was written with false: the two keep Adam's states in different checkpoint layouts. Resume with "
     "actor.use_distributed_optimizer=false (any actor.dp, tp or pp), or start a fresh run from its weights (rlsearch "
     "convert mcore-to-hf, then model.path)"),
])
def test_a_checkpoint_of_another_seed_or_optimizer_layout_is_refused(tmp_path, override, refusal) -> None:
    store = CheckpointStore(tmp_path / "run")
    _save(store, 2, 11, tmp_path)
    config = load_train_config(None, ["trainer.resume=auto", "trainer.seed=11", override])
    with pytest.raises(ConfigError) as refused:
        checkpoint_to_resume(config, store)
    assert str(refused.value) == refusal.format(checkpoint=store.root / "step_000002")


def test_resume_names_a_dir_that_is_no_checkpoint(tmp_path) -> None:
    config = load_train_config(None, [f"trainer.resume={tmp_path}"])
    with pytest.raises(ConfigError) as refused:
        checkpoint_to_resume(config, CheckpointStore(tmp_path / "run"))
    assert str(refused.value).startswith("'trainer.resume' (auto, none or a checkpoint dir): ")
    assert "not an rlsearch checkpoint" in str(refused.value)


def test_the_newest_own_checkpoint_skips_one_that_was_removed(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "run")
    seed = load_train_config(None, []).trainer.seed
    _save(store, 2, seed, tmp_path)
    config = load_train_config(None, [])
    saved = {2: store.root / "step_000002", 4: store.root / "step_000004"}  # step 4's was pruned
    assert newest_own_checkpoint(config, saved).step == 2
    assert newest_own_checkpoint(config, {}) is None


def _files(directory: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def test_resume_auto_skips_a_zeroed_checkpoint_and_says_which_it_takes(tmp_path, capsys) -> None:
    store = CheckpointStore(tmp_path / "run")
    seed = load_train_config(None, []).trainer.seed
    _save(store, 2, seed, tmp_path)
    _save(store, 4, seed, tmp_path)
    damaged = store.root / "step_000004"
    (damaged / "megatron" / "__0_0.distcp").write_bytes(b"\0")  # as many bytes as it was saved with
    point = checkpoint_to_resume(load_train_config(None, ["trainer.resume=auto"]), store)
    assert point.path == store.root / "step_000002"
    assert capsys.readouterr().out.splitlines() == [
        f"[rlsearch] warning: skipping checkpoint step_000004: {damaged} is damaged: megatron/__0_0.distcp no longer "
        "holds the bytes it was saved with (its sha256 differs from the manifest's); use an earlier checkpoint (a "
        "step_* dir beside it)",
        f"[rlsearch] resuming from {store.root / 'step_000002'}, the newest checkpoint that passed its checks"]
    before = _files(tmp_path)
    with pytest.raises(ConfigError) as refused:
        checkpoint_to_resume(load_train_config(None, [f"trainer.resume={damaged}"]), store)
    assert str(refused.value) == (
        f"'trainer.resume' (auto, none or a checkpoint dir): {damaged} is damaged: megatron/__0_0.distcp no longer "
        "holds the bytes it was saved with (its sha256 differs from the manifest's); use an earlier checkpoint (a "
        "step_* dir beside it)")
    assert _files(tmp_path) == before


def test_a_checkpoint_of_another_model_than_model_path_is_refused_naming_both(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "run")
    seed = load_train_config(None, []).trainer.seed
    _save(store, 2, seed, tmp_path, '{"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}')
    moe = tmp_path / "tiny-qwen3-moe"
    moe.mkdir()
    (moe / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, '
                                     '"num_experts": 8}')
    before = _files(tmp_path)
    checkpoint = store.root / "step_000002"
    for resume in ("auto", str(checkpoint)):
        with pytest.raises(ConfigError) as refused:
            checkpoint_to_resume(load_train_config(None, [f"trainer.resume={resume}", f"model.path={moe}"]), store)
        assert str(refused.value) == (
            f"'model.path' ({moe}) is another model than the one the checkpoint {checkpoint} holds (model_type "
            "'qwen2' there, 'qwen3_moe' here; num_hidden_layers 2 there, 4 here): a resumed run builds model.path's "
            "model and loads the checkpoint into it. Set model.path to the model that run trained "
            "(outputs/assets/tiny-qwen2), or start a fresh run with trainer.resume=none")
    assert _files(tmp_path) == before
    old_manifest = checkpoint / "manifest.json"  # from before the shape was recorded: its hf/config.json tells it
    old_manifest.write_text(old_manifest.read_text().replace('"model_shape"', '"unrecorded"'))
    with pytest.raises(ConfigError, match=r"model_type 'qwen2' there, 'qwen3_moe' here; num_hidden_layers 2"):
        checkpoint_to_resume(load_train_config(None, ["trainer.resume=auto", f"model.path={moe}"]), store)
