"""A Ray actor of a training run killed with SIGKILL. The rollout worker, once no engine restart is allowed
(rollout.max_engine_restarts_per_step=0): the trainer stops naming it and the last complete checkpoint. A Megatron
rank: the actor ranks are replaced and the run rewinds to its newest checkpoint, each prompt still trained once; past
trainer.max_actor_restarts the run stops, naming the rank and the checkpoint. (Engines restarted instead:
test_killed_engine.py, test_engine_dies_during_sync.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from tests.constants import REPO_ROOT
from tests.drivers import train_command
from tests.faults.processes import actor_rank_process, engine_processes

# from a kill to the driver's exit, its shutdown included: a hang guard far above what the slowest CPU needs
STOP_HANG_GUARD_S = 300


def _wait_for(log_path, run, text: str, count: int = 1, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while log_path.read_text().count(text) < count:
        assert run.poll() is None, f"the run exited ({run.returncode}) first:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, (f"hang guard: {text!r} not {count} time(s) in the log after "
                                             f"{timeout_s:g} s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)


def _exit_code(run, log_path, after: str) -> int:
    try:
        return run.wait(timeout=STOP_HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"hang guard: the run still going {STOP_HANG_GUARD_S} s after {after}:\n"
                             f"{log_path.read_text()[-3000:]}") from None


def _start(command, log_path, env: dict) -> subprocess.Popen:
    with log_path.open("w") as log:
        return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


def test_a_killed_rollout_worker_stops_the_run_naming_it(tmp_path, tiny_model_dir, toy_data, driver_ray):
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    command = train_command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir,
                            "rollout.max_engine_restarts_per_step=0")
    run = _start(command, log_path, driver_ray)
    try:
        _wait_for(log_path, run, "checkpoints/step_000001")
        (engine,) = engine_processes().values()
        os.kill(engine.pid, signal.SIGKILL)
        killed = time.monotonic()
        returncode = _exit_code(run, log_path, "its rollout engine was killed")
        stopped_after_s = time.monotonic() - killed
    finally:
        if run.poll() is None:
            run.kill()
    output = log_path.read_text()
    assert returncode == 1, output[-3000:]
    message = next(line for line in output.splitlines() if line.startswith("rlsearch train:"))
    assert "rollout engine 0 died (its process exited)" in message
    assert f"the last complete checkpoint is {run_dir / 'checkpoints' / 'step_000001'}" in message
    print(f"\nrollout engine 0: killed during step 2, the driver exited {stopped_after_s:.1f} s later")
    assert "Traceback" not in output.split("checkpoints/step_000001")[-1]
    assert not list((run_dir / "checkpoints").glob(".incomplete_*"))


def test_a_killed_actor_rank_is_replaced_and_the_async_run_rewinds_to_its_checkpoint_training_each_prompt_once(
    tmp_path, tiny_model_dir, toy_data, driver_ray
):
    """4 async steps of PPO with the critic, a checkpoint every 2. The actor rank is killed right after step 3's line
    (step 4's rollout in flight): the actor and critic ranks are replaced, the run rewinds to step 2 (both models'
    states) and trains step 3 again; the critic rank killed then, past trainer.max_actor_restarts=1, the run stops
    naming it and the checkpoint of step 2."""
    from collections import Counter

    from rlsearch.data import load_qa_dataset
    from rlsearch.trainer.sampler import EpochSampler

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    command = train_command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir, "trainer.total_steps=4",
                            "trainer.save_interval=2", "trainer.print_interval=1", "rollout.async_steps=1",
                            "rollout.update_weights_in_flight=true", "trainer.max_actor_restarts=1",
                            "algo.advantage=gae")
    run = _start(command, log_path, driver_ray)
    try:
        _wait_for(log_path, run, "step 3/4 |")
        engines = _engine_pids()
        os.kill(actor_rank_process(run_dir).pid, signal.SIGKILL)
        killed = time.monotonic()
        _wait_for(log_path, run, "step 3/4 |", count=2, timeout_s=300)
        recovered_s = time.monotonic() - killed
        assert engines and _engine_pids() == engines  # the engines stayed up
        os.kill(actor_rank_process(run_dir, role="critic").pid, signal.SIGKILL)
        returncode = _exit_code(run, log_path, "its critic rank was killed")
    finally:
        if run.poll() is None:
            run.kill()
    output = log_path.read_text()
    print(f"\nactor rank 0 killed after step 3: step 3 trained again {recovered_s:.1f} s later")
    checkpoint = run_dir / "checkpoints" / "step_000002"
    rank = "actor rank 0 (tp 0, pp 0, cp 0, dp 0)"
    assert (f"{rank} died during step 4: the actor ranks were replaced (1 of trainer.max_actor_restarts=1) and the "
            f"run continues after step 2 ({checkpoint})") in output, output[-3000:]
    assert "restarted rollout engine" not in output
    assert "the critic resumed with it" in output  # the rewind restored the critic's state too
    assert returncode == 1, output[-3000:]
    message = next(line for line in output.splitlines() if line.startswith("rlsearch train:"))
    critic = "critic rank 0 (tp 0, pp 0, cp 0, dp 0)"
    assert f"{critic} died (its process exited) during step 4 (Ray: SYSTEM_ERROR: " in message  # how Ray saw it die
    assert f"the last complete checkpoint is {checkpoint}" in message
    assert "(after 1 actor restart(s) in this run: trainer.max_actor_restarts=1)" in message

    config = json.loads((run_dir / "config.json").read_text())
    batch_size, group_size = config["data"]["batch_size"], config["rollout"]["group_size"]
    order = [e.id for e in EpochSampler(load_qa_dataset(toy_data.train), config["trainer"]["seed"],
                                        config["data"]["shuffle"]).next_batch(3 * batch_size)]
    records = [json.loads(line) for step in (1, 2, 3)
               for line in (run_dir / "trajectories" / f"step_{step:06d}.jsonl").open()]
    assert Counter((r["example_id"], r["sample_index"]) for r in records) == Counter(
        {(example_id, sample): 1 for example_id in order for sample in range(group_size)})
    assert not (run_dir / "trajectories" / "step_000004.jsonl").exists()


def _engine_pids() -> list[int]:
    return sorted(process.pid for process in engine_processes().values())
