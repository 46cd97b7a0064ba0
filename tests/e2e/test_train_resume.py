"""A training run whose driver is killed with SIGKILL during step 3 is run again by its supervisor (`rlsearch train
--restarts 1`), takes over the rollout engine the dead driver left under the supervisor's Ray, resumes from its
step-2 checkpoint to exactly the run that was never interrupted (PPO: a critic of full weights beside an actor that
trains LoRA adapters), and its checkpoint converts to the trained HF model. An async run (rollout.async_steps=1) with
two engines and a user agent (examples/agents/search_r1.py through the engines' endpoints), killed the same way with
step 4's rollout in flight, takes both engines over, their endpoints included, and trains every prompt of the
sampler's order exactly once. A rerun of the first 2 steps with tools.replay, from the uninterrupted run's tool store
alone, samples the same tokens on the engine it takes over from the uninterrupted run (both drivers join the test
session's Ray). Each run is a fixture of its own, run one after another. (Resuming into another layout is
tests/integration/test_actor_resume.py: bit-exact weights and the same next step at TP2.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.constants import REPO_ROOT, SHORT_TURNS

STEPS, SAVE_INTERVAL = 4, 2
# A random model earns no reward, so GRPO alone would leave the weights as they are; the k1 KL term has a gradient
# from the first step on, so every step changes the weights and the optimizer state.
COMPARED = ("actor/policy_loss", "actor/kl_loss", "actor/grad_norm", "actor/approx_kl", "reward/mean",
            "rollout/response_len_mean", "rollout/tool_calls_mean")
# The uninterrupted, replayed and killed runs train PPO with the critic (its own ranks and checkpoint, every weight
# trained) and an actor that trains rank-8 adapters (actor.lora: their Adam state in the checkpoint, the reference
# policy the adapters off); the async run trains GRPO on every weight. The resumed steps must give both models'
# figures of the uninterrupted run.
PPO = ("algo.advantage=gae", "critic.lr=1e-4", "actor.lora.rank=8", "actor.lr=1e-3")
CRITIC_COMPARED = ("critic/value_loss", "critic/grad_norm", "critic/value_mean")  # no reward: no return variance


RESTART_LINE = "[rlsearch] the training driver died (killed by SIGKILL); restart 1 of 1 with trainer.resume=auto\n"


def _command(assets, output_dir, supervised: bool = False, *overrides: str):
    return [
        sys.executable, "-m", "rlsearch", "train", *(["--restarts", "1"] if supervised else []),
        "--config", "examples/configs/search_grpo_tiny.yaml",
        f"model.path={assets.model}", f"data.train_files=[{assets.data.train}]",
        f"tools.retriever.corpus={assets.data.corpus}", f"tools.retriever.index_cache_dir={assets.index_cache}",
        "data.batch_size=2", f"trainer.total_steps={STEPS}", f"trainer.save_interval={SAVE_INTERVAL}",
        "algo.kl_coef=0.1", "algo.kl_estimator=k1", SHORT_TURNS, f"trainer.output_dir={output_dir}", *overrides,
    ]


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _response_ids(run_dir, step):
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line)["response_ids"] for line in path.open()]


def _start(command, log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as log:  # a log file: nobody reads pipes meanwhile
        return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


def _kill_driver_after_step_2_checkpoint(supervisor: subprocess.Popen, log_path: Path, delay_s: float) -> None:
    deadline = time.monotonic() + 900
    while "checkpoints/step_000002" not in log_path.read_text() and supervisor.poll() is None:
        assert time.monotonic() < deadline, (
            "no step-2 checkpoint in 900 s (a hang guard): " + log_path.read_text()[-3000:])
        time.sleep(0.05)
    time.sleep(delay_s)
    assert supervisor.poll() is None, log_path.read_text()[-3000:]
    # the driver only: its tool servers must go with it, the engines and the actor ranks (under the supervisor's
    # Ray) must be taken over by the next driver
    (driver,) = [child for child in psutil.Process(supervisor.pid).children()
                 if child.cmdline()[1:4] == ["-m", "rlsearch", "train"]]
    os.kill(driver.pid, signal.SIGKILL)


def _killed_and_resumed_output(supervisor: subprocess.Popen, log_path: Path) -> tuple[str, str]:
    assert supervisor.wait(timeout=900) == 0, log_path.read_text()[-3000:]
    killed_output, restart, resumed_output = log_path.read_text().partition(RESTART_LINE)
    assert restart, killed_output[-3000:]
    return killed_output, resumed_output


@pytest.fixture(scope="module")
def assets(module_tmp, tiny_model_dir, toy_data):
    base = module_tmp.mktemp("train_runs")
    return SimpleNamespace(model=tiny_model_dir, data=toy_data, index_cache=base / "bm25", base=base)


def _run_to_the_end(command, log_path: Path, env: dict) -> str:
    with log_path.open("w") as log:  # a file: the output of a long run is read once it ended
        run = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900,
                             env={**os.environ, **env})
    output = log_path.read_text()
    assert run.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def reference(assets, driver_ray):
    """The uninterrupted run, then a rerun of its first 2 steps with tools.replay from its tool store alone (no
    corpus: a retriever could not even start), which takes over the reference's engine."""
    reference_dir, replay_dir = assets.base / "reference", assets.base / "replay"
    output = _run_to_the_end(_command(assets, reference_dir, False, *PPO), assets.base / "reference.log", driver_ray)
    replay_output = _run_to_the_end(
        _command(assets, replay_dir, False, *PPO, "trainer.total_steps=2", "tools.replay=true",
                 f"tools.cache_dir={reference_dir / 'tool_store'}", "tools.retriever.corpus=/nonexistent"),
        assets.base / "replay.log", driver_ray)
    return SimpleNamespace(dir=reference_dir, output=output, replay_dir=replay_dir, replay_output=replay_output)


@pytest.fixture(scope="module")
def killed(assets):
    """The run killed during step 3's rollout, under its supervisor (its own Ray, which the engine outlives the
    driver in)."""
    resumed_dir, log_path = assets.base / "resumed", assets.base / "doomed.log"
    doomed = _start(_command(assets, resumed_dir, True, *PPO), log_path)
    _kill_driver_after_step_2_checkpoint(doomed, log_path, delay_s=0.5)  # into step 3's rollout
    killed_output, resumed_output = _killed_and_resumed_output(doomed, log_path)
    return SimpleNamespace(dir=resumed_dir, killed_output=killed_output, resumed_output=resumed_output)


@pytest.fixture(scope="module")
def killed_async(assets):
    """The async run with two engines and a user agent, killed right after step 2's checkpoint: step 3 trains on
    the rollout made during step 2, while step 4's is rolled out."""
    async_dir, log_path = assets.base / "async", assets.base / "async.log"
    doomed = _start(_command(assets, async_dir, True, "rollout.async_steps=1", "rollout.num_engines=2",
                             "rollout.agent=examples.agents.search_r1:agent"), log_path)
    _kill_driver_after_step_2_checkpoint(doomed, log_path, delay_s=0.3)
    killed_output, resumed_output = _killed_and_resumed_output(doomed, log_path)
    return SimpleNamespace(dir=async_dir, killed_output=killed_output, resumed_output=resumed_output)


def test_killed_run_resumes_after_its_last_checkpoint(killed):
    assert "step 2/4" in killed.killed_output and "step 3/4" not in killed.killed_output
    assert "resumed from" in killed.resumed_output and "step_000002 after step 2" in killed.resumed_output
    # the engine and the actor rank lived on under the supervisor's Ray, and the new driver took them over instead
    # of starting new ones (the resumed steps equal the uninterrupted run's: the next test)
    assert "rollout engine 0 outlived the previous driver and was taken over" in killed.resumed_output
    assert "actor rank 0 outlived the previous driver and was taken over" in killed.resumed_output
    assert "step 1/4" not in killed.resumed_output and "step 3/4 | reward" in killed.resumed_output
    assert ("trained 2 steps" in killed.resumed_output
            and "(resumed after step 2, now at step 4)" in killed.resumed_output)
    restarts = (killed.dir / "logs" / "restarts.log").read_text().splitlines()
    assert len(restarts) == 1 and restarts[0].endswith(RESTART_LINE.removeprefix("[rlsearch] ").strip())


def test_resumed_steps_equal_the_uninterrupted_run(reference, killed):
    reference_scalars, resumed = _scalars(reference.dir), _scalars(killed.dir)
    for tag in COMPARED + CRITIC_COMPARED:
        # TensorBoard steps continue: 1-2 from the killed run, 3-4 from the resumed one, each step once
        assert [step for step, _ in resumed[tag]] == list(range(1, STEPS + 1)), tag
        for (step, want), (_, got) in zip(reference_scalars[tag], resumed[tag]):
            assert got == pytest.approx(want, abs=1e-6, rel=1e-6), (tag, step)
    kl = dict(resumed["actor/kl_loss"])
    assert abs(kl[3]) > 1e-6  # the policy had moved from the reference: step 3 trained on restored weights
    values = [value for _, value in resumed["critic/value_mean"]]
    assert len(set(values)) == STEPS  # the critic trained every step: step 3's values are its restored weights
    for step in range(1, STEPS + 1):
        assert _response_ids(killed.dir, step) == _response_ids(reference.dir, step), step


def test_an_async_run_killed_with_a_rollout_in_flight_trains_each_prompt_once_after_async_resume(
    killed_async, assets
):
    """The checkpoint of step 2 records the data position after step 2's batch; the batches rolled out ahead of it
    (steps 3 and 4 here) are drawn again from there after the resume, so none is skipped or trained twice."""
    from collections import Counter

    from rlsearch.data import load_qa_dataset
    from rlsearch.trainer.sampler import EpochSampler

    assert "step 2/4" in killed_async.killed_output and "step 3/4" not in killed_async.killed_output
    for engine in (0, 1):  # each engine is taken over on its own: both lived on, neither was started anew
        assert f"rollout engine {engine} outlived the previous driver and was taken over" in killed_async.resumed_output
    config = json.loads((killed_async.dir / "config.json").read_text())
    assert config["rollout"]["async_steps"] == 1
    batch_size, group_size = config["data"]["batch_size"], config["rollout"]["group_size"]
    examples = load_qa_dataset(assets.data.train)
    order = [e.id for e in EpochSampler(examples, config["trainer"]["seed"], config["data"]["shuffle"]).next_batch(
        STEPS * batch_size)]
    records = [json.loads(line) for step in range(1, STEPS + 1)
               for line in (killed_async.dir / "trajectories" / f"step_{step:06d}.jsonl").open()]
    # the user agent ran every trajectory, before the kill and through the taken-over engines' endpoints after it
    assert config["rollout"]["agent"] == "examples.agents.search_r1:agent"
    assert not any(r["failed"] for r in records)
    assert Counter((r["example_id"], r["sample_index"]) for r in records) == Counter(
        {(example_id, sample): 1 for example_id in order for sample in range(group_size)})
    for step in range(1, STEPS + 1):  # and in the sampler's order, step by step
        rows = [r for r in records if r["step"] == step]
        assert sorted({r["example_id"] for r in rows}) == sorted(order[(step - 1) * batch_size:step * batch_size])


def test_a_replay_of_the_run_from_its_tool_store_makes_no_call_and_samples_the_same_tokens(reference):
    # the replay took the reference's engine over: a run's tokens do not depend on whose engine samples them
    assert "rollout engine 0 outlived the previous driver and was taken over" in reference.replay_output
    for step in (1, 2):
        assert _response_ids(reference.replay_dir, step) == _response_ids(reference.dir, step), step
        path = reference.replay_dir / "trajectories" / f"step_{step:06d}.jsonl"
        records = [json.loads(line) for line in path.open()]
        calls = [call for r in records for turn in r["turns"] for call in turn["tool_calls"]]
        assert calls and all(call["cached"] and call["ok"] for call in calls)
    assert ("calls out        : per 1,000 trajectories: tools 0.0 (paid web APIs 0.0), judge 0.0"
            in reference.replay_output)
    recorded = re.search(r"calls out +: per 1,000 trajectories: tools ([\d.]+) \(paid web APIs 0.0\)",
                         reference.output)
    assert recorded and float(recorded[1]) > 0, reference.output[-2000:]


def test_checkpoints_are_complete_and_nothing_was_left_running(killed, assets):
    from rlsearch.checkpoint import load_run_checkpoint

    checkpoints = killed.dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002", "step_000004"]
    manifest, state = load_run_checkpoint(checkpoints / "step_000004")
    assert state["step"] == 4 and state["sampler"] == {"epoch": 0, "position": 8}
    assert manifest["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "ep": 1, "virtual_pipeline_stages": 0}
    assert manifest["critic_layout"] == manifest["layout"] and "critic" in manifest["contents"]
    assert manifest["lora"]["rank"] == 8
    assert (checkpoints / "step_000004" / "critic" / "metadata.json").is_file()  # the critic's torch_dist state
    leftovers = subprocess.run(["pgrep", "-f", str(assets.index_cache)], capture_output=True, text=True)
    assert leftovers.stdout == "", "a tool server of the killed run is still running"


def test_convert_run_checkpoint_to_hf_gives_the_trained_model(reference, tiny_model_dir):
    """The merged model: every matrix the adapters adapt changed, every other tensor is the base's bit for bit."""
    import torch
    from safetensors.torch import load_file

    from rlsearch.checkpoint import mcore_to_hf

    out = reference.dir.parent / "hf_step_4"
    result = mcore_to_hf(reference.dir / "checkpoints" / "step_000004", out, verify=True)
    assert result.max_logit_diff < 1e-5  # transformers on the written dir vs the Megatron model from the checkpoint
    converted = {name: tensor for shard in out.glob("*.safetensors") for name, tensor in load_file(shard).items()}
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert set(converted) == set(initial)
    adapted = {name for name in initial if re.search(r"\.(q|k|v|o|gate|up|down)_proj\.weight$", name)}
    assert len(adapted) == 7 * sum(1 for name in initial if name.endswith("input_layernorm.weight"))
    assert all(not (converted[name] == initial[name]).all() for name in adapted)
    assert all(torch.equal(converted[name], initial[name]) for name in set(initial) - adapted)
