"""Stopped runs continue to what runs never stopped end with:
- `rlsearch sft` killed (SIGKILL) after a checkpoint and started again ends with the weights and the per-step losses of
  the run that was never stopped (within 1e-6; the same machine gives the same sums);
- one started again after its data file was written again under its name is refused naming the file, before Ray
  starts and without writing anything (the other settings' refusals: tests/unit/test_sft_checkpoints.py);
- bench/learning.py killed during its SFT and started again continues that SFT from its checkpoint and runs the
  stages after it; started a third time it reuses every stage and runs nothing (this is the bench's smoke run).
A GRPO run killed mid-way that resumes to the uninterrupted run's steps is tests/e2e/test_train_resume.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.constants import REPO_ROOT

SFT_CONFIG = "examples/configs/sft_tiny.yaml"
STEPS, SAVE_INTERVAL, BATCH = 6, 2, 4
HANG_GUARD_S = 900  # for the slowest CPU seen; the checkpoint comes within a minute on a fast one


def _sft_overrides(model: Path, demos: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model}", f"data.train_files=[{demos}]", f"data.batch_size={BATCH}",
            f"data.max_steps={STEPS}", f"save_interval={SAVE_INTERVAL}", f"output_dir={out}", "seed=3",
            # one torch thread: with two, the order a CPU sums gradients in varies from run to run, and two
            # uninterrupted runs were seen to end up to 2.3e-4 apart; with one they are bit-identical
            "actor.num_threads=1", "log_interval=1", *extra]


def _kill_when(process: subprocess.Popen, found, what: str, log: Path) -> None:
    """SIGKILL `process` and every process under it (its Ray's too) once `found()` is true."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not found():
        assert process.poll() is None, f"it ended before {what}: " + log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what} in {HANG_GUARD_S} s (a hang guard): " + log.read_text()[-3000:]
        time.sleep(0.05)
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for member in tree:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=60)


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    shards = sorted(model_dir.glob("*.safetensors"))
    return {name: tensor for shard in shards for name, tensor in load_file(shard).items()}


def test_an_sft_killed_after_a_checkpoint_resumes_to_the_uninterrupted_weights(ray_local, tiny_model_dir, toy_data,
                                                                                tmp_path):
    from rlsearch.config import load_sft_config
    from rlsearch.data.demos import bm25_search, write_demonstrations
    from rlsearch.runlog import read_scalars
    from rlsearch.trainer import run_sft

    demos = write_demonstrations(toy_data.train, tmp_path / "sft.jsonl", bm25_search(toy_data.corpus), topk=1).path
    uninterrupted = run_sft(load_sft_config(SFT_CONFIG, _sft_overrides(tiny_model_dir, demos, tmp_path / "whole")))

    # the same run as a user starts it, on the session's Ray, killed once it saved its step-2 checkpoint: in step 3,
    # or later (even while it writes step 4's, which it then never finished)
    killed_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    gcs = ray_local.get_runtime_context().gcs_address
    with log.open("w") as out:
        doomed = subprocess.Popen(
            [sys.executable, "-m", "rlsearch", "sft", "--config", SFT_CONFIG,
             *_sft_overrides(tiny_model_dir, demos, killed_dir, f"ray_address={gcs}")],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    _kill_when(doomed, lambda: "checkpoint saved" in log.read_text(), "step-2 checkpoint", log)
    assert not (killed_dir / "hf").exists()

    resumed = run_sft(load_sft_config(SFT_CONFIG, _sft_overrides(tiny_model_dir, demos, killed_dir)))
    assert resumed.resumed_step in (2, 4), resumed.render()
    assert f"(resumed after step {resumed.resumed_step})" in resumed.render()
    whole, continued = _weights(uninterrupted.model_dir), _weights(resumed.model_dir)
    assert set(whole) == set(continued)
    initial = _weights(tiny_model_dir)
    for name, tensor in whole.items():
        assert (continued[name] - tensor).abs().max() <= 1e-6, name
        assert not (tensor == initial[name]).all(), name  # every tensor was trained, so the comparison means something
    # TensorBoard: each step once, the steps before the kill from the killed run, the rest from the resumed one
    want, got = read_scalars(tmp_path / "whole" / "tensorboard"), read_scalars(killed_dir / "tensorboard")
    for tag in ("sft/loss", "actor/grad_norm"):
        assert [step for step, _ in got[tag]] == list(range(1, STEPS + 1)), tag
        assert [value for _, value in got[tag]] == pytest.approx([value for _, value in want[tag]], abs=1e-6), tag
    assert resumed.first_loss == pytest.approx(uninterrupted.first_loss, abs=1e-6)
    assert resumed.last_loss == pytest.approx(uninterrupted.last_loss, abs=1e-6)
    assert sorted(path.name for path in (killed_dir / "checkpoints").iterdir()) == ["latest", "step_000004"]


def test_an_sft_refuses_a_checkpoint_whose_data_file_was_written_again(tiny_model_dir, tmp_path):
    from rlsearch.checkpoint import CheckpointStore
    from rlsearch.config import ConfigError, load_sft_config
    from rlsearch.trainer import run_sft
    from rlsearch.trainer.sampler import SamplerState
    from rlsearch.trainer.sft import _save_checkpoint, _settings

    out, demos = tmp_path / "sft", tmp_path / "sft.jsonl"
    row = '{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "a"}]}\n'
    demos.write_text(row % "q")
    config = load_sft_config(SFT_CONFIG, _sft_overrides(tiny_model_dir, demos, out))
    # this run's complete checkpoint after step 2 (its model is never read: the refusal comes first)
    _save_checkpoint(CheckpointStore(out, keep=1), 2, lambda model_dir: None, config, SamplerState(0, 2 * BATCH),
                     _settings(config, STEPS), 1.0)
    demos.write_text(row % "another question")  # regenerated under the same name: other rows at the saved position
    before = sorted(out.rglob("*"))
    named = re.escape(f"is of another SFT run (the contents (sha256) of {demos} ")
    with pytest.raises(ConfigError, match=named + r"'[0-9a-f]{64}' there, '[0-9a-f]{64}' here\): .* or start over "
                                                  r"with resume=none or another output_dir$"):
        run_sft(config)
    assert sorted(out.rglob("*")) == before  # stopped before Ray: no sft_config.json, no logs


def test_a_bench_killed_during_its_sft_continues_it_and_then_reuses_every_stage(tmp_path):
    out = tmp_path / "learning"
    command = [sys.executable, "bench/learning.py", "--smoke", "--out", str(out)]
    first = tmp_path / "first.log"
    with first.open("w") as log:
        doomed = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)

    def sft_checkpointed() -> bool:
        return any("checkpoint saved" in path.read_text() for path in out.glob("seed_*/sft.log"))

    _kill_when(doomed, sft_checkpointed, "SFT checkpoint", first)
    (sft_log,) = out.glob("seed_*/sft.log")
    assert not (sft_log.parent / "sft" / "hf").exists()

    second = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "Traceback" not in second.stdout + second.stderr
    assert "[rlsearch sft] resumed from" in sft_log.read_text() and "after step 1" in sft_log.read_text()
    assert "EM random nan, SFT" in second.stdout  # the table of every stage, the smoke's random eval skipped
    stages = [line.split()[0] for line in second.stdout.splitlines() if "CPU-s" in line]
    assert stages == ["sft", "eval", "train"], second.stdout  # the data were made before the kill

    third = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert third.returncode == 0, (third.stdout + third.stderr)[-4000:]
    assert "CPU-s" not in third.stdout, third.stdout  # no stage ran
    assert [line.split()[0] for line in third.stdout.splitlines() if " reused " in line] == ["eval", "train"]
    assert third.stdout.splitlines()[-1] == second.stdout.splitlines()[-1]  # the same EMs, read back
