"""The checkpoint an SFT run resumes (trainer/sft.py), on checkpoints its own save path writes into tmp_path: one saved
with anything that would end the run elsewhere (a data file written again under its name, Adam's betas, the
schedule, the distributed optimizer) is refused naming it and what to do, and the refusal writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsearch.checkpoint import CheckpointStore
from rlsearch.config import ConfigError, SFTConfig, SFTDataConfig
from rlsearch.files import file_sha256
from rlsearch.trainer.checkpoints import ResumePoint
from rlsearch.trainer.sampler import SamplerState
from rlsearch.trainer.sft import _checkpoint_to_resume, _save_checkpoint, _settings

TOTAL_STEPS = 10
ROW = '{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "a"}]}\n'


def _config(tmp_path: Path, **actor) -> SFTConfig:
    hf = tmp_path / "model"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text('{"model_type": "qwen2"}')
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        data.write_text(ROW % "q1" + ROW % "q2")
    config = SFTConfig(data=SFTDataConfig(train_files=[str(data)], batch_size=4), output_dir=str(tmp_path / "out"))
    config.model.path = str(hf)
    for key, value in actor.items():
        setattr(config.actor, key, value)
    return config


def _saved_run(tmp_path: Path, unrecorded: str = "") -> tuple[CheckpointStore, Path]:
    """The store of a run that saved its step-2 checkpoint with _config's settings (less `unrecorded`: one an older
    rlsearch did not record), and that checkpoint."""
    config = _config(tmp_path)
    store = CheckpointStore(config.output_dir, keep=1)
    settings = {key: value for key, value in _settings(config, TOTAL_STEPS).items() if key != unrecorded}

    def write_model(directory: str) -> None:
        (Path(directory) / "__0_0.distcp").write_bytes(b"x")

    return store, _save_checkpoint(store, 2, write_model, config, SamplerState(0, 8), settings, 3.5)


def _resume(config: SFTConfig, store: CheckpointStore):
    return _checkpoint_to_resume(config, store, _settings(config, TOTAL_STEPS))


def _files(root: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_the_same_settings_resume_the_checkpoint(tmp_path) -> None:
    store, path = _saved_run(tmp_path)
    point, state = _resume(_config(tmp_path), store)
    assert point == ResumePoint(path, _config(tmp_path).actor.layout, 2, SamplerState(0, 8))
    assert state["first_loss"] == 3.5
    data = tmp_path / "sft.jsonl"
    assert state["settings"][f"the contents (sha256) of {data}"] == file_sha256(data)
    assert state["settings"]["actor.adam_beta2"] == 0.999


def test_a_data_file_written_again_under_its_name_is_refused_naming_it(tmp_path) -> None:
    store, path = _saved_run(tmp_path)
    data = tmp_path / "sft.jsonl"
    before = file_sha256(data)
    data.write_text(ROW % "other" + ROW % "rows")  # regenerated: the same path, other rows at the saved position
    written = _files(tmp_path)
    with pytest.raises(ConfigError) as refused:
        _resume(_config(tmp_path), store)
    assert str(refused.value) == (
        f"the checkpoint {path} is of another SFT run (the contents (sha256) of {data} '{before}' there, "
        f"'{file_sha256(data)}' here): a resumed run continues at its data position with its Adam state, so each "
        "must be as it was when it was saved. Give them as they were (a data file: its contents then), or start over "
        "with resume=none or another output_dir")
    assert _files(tmp_path) == written


@pytest.mark.parametrize("key, value, saved", [
    ("adam_beta1", 0.8, 0.9), ("adam_beta2", 0.95, 0.999), ("weight_decay", 0.1, 0.0), ("lr", 1e-4, 1e-3),
    ("lr_warmup_steps", 3, 0), ("lr_decay_style", "cosine", "constant"), ("min_lr", 1e-5, 0.0),
    ("clip_grad", 0.5, 1.0),
])
def test_another_adam_setting_or_schedule_is_refused_naming_the_key(tmp_path, key, value, saved) -> None:
    store, _ = _saved_run(tmp_path)
    with pytest.raises(ConfigError, match=rf"is of another SFT run \(actor\.{key} {saved!r} there, {value!r} here\): "
                                          r".* or start over with resume=none or another output_dir$"):
        _resume(_config(tmp_path, **{key: value}), store)


def test_the_other_distributed_optimizer_is_refused_as_grpo_refuses_it(tmp_path) -> None:
    store, path = _saved_run(tmp_path)
    with pytest.raises(ConfigError) as refused:
        _resume(_config(tmp_path, use_distributed_optimizer=True), store)
    assert str(refused.value) == (
        f"'actor.use_distributed_optimizer' is true but the checkpoint {path} was written with false: the two keep "
        "Adam's states in different checkpoint layouts. Resume with actor.use_distributed_optimizer=false (any "
        "actor.dp, tp or pp), or start over with resume=none or another output_dir")


def test_a_checkpoint_without_recorded_settings_is_refused_saying_so(tmp_path) -> None:
    store, _ = _saved_run(tmp_path, unrecorded="actor.adam_beta1")
    with pytest.raises(ConfigError, match=r"\(actor\.adam_beta1 not recorded there, 0\.9 here\)"):
        _resume(_config(tmp_path), store)


def test_resume_none_starts_over(tmp_path) -> None:
    store, _ = _saved_run(tmp_path)
    config = _config(tmp_path, adam_beta1=0.5)
    config.resume = "none"
    assert _resume(config, store) is None
