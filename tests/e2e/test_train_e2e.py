"""The README's main command, end to end on CPU, checked through what it writes. The default run warm-starts from
a short SFT; the other runs here train the random-init model as it is (RLSEARCH_WARM_START=none)."""

import json
import re
import sys

import pytest

from bench.readme_check import MISMATCH_LIMIT
from tests.constants import SHORT_TURNS
from tests.drivers import run_from_repo, run_search_grpo
from tests.models import model_override

REQUIRED_SCALARS = (
    "reward/mean", "reward/std", "reward/em", "rollout/response_len_mean", "rollout/turns_mean",
    "rollout/tool_calls_mean", "rollout/invalid_calls_mean", "rollout/tool_errors", "actor/policy_loss",
    "actor/clip_fraction", "actor/approx_kl", "actor/grad_norm", "time/rollout_s", "time/train_s", "time/sync_s",
    "weights/logprob_mismatch_max",
)


def test_default_run_is_quiet_names_its_logs_and_trains_from_step_1(default_run):
    """The default run: the SFT warm start (made once), then 30 GRPO steps. At most 30 terminal lines and none from a
    library, besides the warm start's progress lines (at doubling gaps: a slow CPU adds one, 5 cover 15 minutes);
    vLLM, Ray and Megatron write into a file per process under output_dir/logs. The reward varies within
    groups from step 1 (format and search terms), so the first step already has a non-zero gradient. Every step is
    logged (TensorBoard scalars, trajectories) and the last one checkpointed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, result, _ = default_run
    terminal = (result.stdout + result.stderr).splitlines()
    print("\n".join(terminal))
    progress = [line for line in terminal if line.startswith("[rlsearch]   ... ")]
    assert len(terminal) - len(progress) <= 30 and len(progress) <= 5, terminal
    assert f"library logs     : {out / 'logs'}" in result.stdout
    assert not [line for line in terminal if re.search(r"WARNING|INFO|pid=|Loading|it/s", line)]
    logs = {re.sub(r"-\w+\.log$", "", path.name) for path in (out / "logs").iterdir()}
    assert {"driver.log", "actor-rank0", "rollout-engine", "retriever"} <= logs, logs
    engine_log = next((out / "logs").glob("rollout-engine-*.log")).read_text()
    assert "vllm" in engine_log.lower()  # the engine's own output went there
    assert "step 30/30 | reward" in result.stdout and "over the run     : reward" in result.stdout
    assert f"TensorBoard      : tensorboard --logdir {out / 'tensorboard'}" in result.stdout

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in REQUIRED_SCALARS:
        assert [e.step for e in events.Scalars(name)] == list(range(1, 31)), name
    assert events.Scalars("reward/std")[0].value > 0
    assert events.Scalars("actor/grad_norm")[0].value > 0
    # the warm-started model's probe gaps are larger than a random model's (its logits are sharper): up to 2.2e-4 on
    # the README's CPU and 6.3e-4 on a 2-core AMD EPYC with AVX2 over 30 steps; bench/readme_check.py's limit
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < MISMATCH_LIMIT
    config = json.loads((out / "config.json").read_text())
    for step in range(1, 31):
        rows = [json.loads(line) for line in (out / "trajectories" / f"step_{step:06d}.jsonl").open()]
        assert len(rows) == config["data"]["batch_size"] * config["rollout"]["group_size"]
        assert all(len(r["response_ids"]) == len(r["loss_mask"]) for r in rows)
    checkpoint = out / "checkpoints" / "step_000030"
    assert (out / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 30
    assert any((checkpoint / "megatron").iterdir())


def test_the_default_run_bench_reads_what_the_run_says_of_itself(default_run):
    """bench/default_run.py ran the default run (conftest's `default_run`): its table's reward over the first and the
    last third of the steps (read back from TensorBoard) is the run's own summary of its first and last 10 steps, and
    it counted the run's terminal lines."""
    _, result, bench = default_run
    (row,) = [line for line in bench.splitlines() if line.startswith("seed 1 learn ")]
    first, last = map(float, re.search(r"\| reward ([\d.]+) -> ([\d.]+) \|", row).groups())
    summary = re.search(r"over the run     : reward ([\d.]+) -> ([\d.]+),", result.stdout)
    assert abs(first - float(summary[1])) <= 1e-3 and abs(last - float(summary[2])) <= 1e-3, (row, summary[0])
    assert f"| {len(result.stdout.splitlines())} terminal lines |" in row
    assert re.search(r"^reward gain \(last third - first third\), mean \(std\) over 1 seeds: learning [-+][\d.]+$",
                     bench, re.M), bench


def test_run_search_grpo_script_trains_with_tp2_pp2_and_async_rollout(async_tp2pp2_run):
    """Four Megatron ranks (TP2 x PP2) on gloo, packed micro-batches through the pipeline schedule; the rollout of
    step 2 overlaps the training of step 1 (rollout.async_steps=1), so it samples with weights one update old."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, result = async_tp2pp2_run
    assert "step 2/2 | reward" in result.stdout
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    # a random model earns no reward, so gradients may be zero here; the layout parity tests check the math
    assert [e.step for e in events.Scalars("actor/update_ok")] == [1, 2]
    assert all(e.value == 1.0 for e in events.Scalars("actor/update_ok"))
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
    assert [e.value for e in events.Scalars("rollout/staleness")] == [0.0, 1.0]
    # the step-1 sync may land on step 2's rollout in flight (rollout.update_weights_in_flight)
    assert all(0.0 <= e.value <= 1.0 for e in events.Scalars("rollout/mixed_policy_fraction"))
    assert all(e.value >= 0.0 for e in events.Scalars("time/engine_idle_s"))
    # the stale batch is corrected towards the actor's policy: importance weights near 1 for a 1e-4 learning rate
    assert all(0.5 < e.value < 2.0 for e in events.Scalars("actor/tis_weight_mean"))
    assert (out / "checkpoints" / "step_000002" / "megatron").is_dir()
    # periodic eval of the trained policy through the eval-only code path, after every step (trainer.eval_interval)
    assert [e.step for e in events.Scalars("eval/overall/em")] == [1, 2]
    summary = json.loads((out / "eval" / "step_000002" / "summary.json").read_text())
    assert summary["metrics"]["overall"]["questions"] == 4
    assert "eval after step 2: EM" in result.stdout


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.total_step=3"], "unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?"),
        (["data.train_files=[{bad}]"], "{bad}:2: invalid JSON"),
        # the tiny model has 4 attention heads and 2 key-value heads
        (["actor.tp=4"], "actor.tp=4 must divide num_key_value_heads=2 of"),
    ],
)
def test_train_cli_rejects_bad_input_with_a_clear_message(tmp_path, tiny_model_dir, overrides, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["a"]}\n{"question": oops\n')
    overrides = [o.format(bad=bad) for o in overrides] + [f"model.path={tiny_model_dir}"]
    result = run_from_repo([sys.executable, "-m", "rlsearch", "train", "--config",
                            "examples/configs/search_grpo_tiny.yaml", *overrides], timeout=120)
    assert result.returncode == 2
    assert expected.format(bad=bad) in result.stderr


def test_activation_offload_stops_a_cpu_run_before_any_rank_starts(tmp_path, tiny_model_dir, toy_data, retriever):
    """actor.activation_offload on a cluster without GPUs: refused once the trainer knows the cluster's devices,
    naming the key and why, with exit status 2, before any engine or actor rank starts (no logs of theirs)."""
    out = tmp_path / "run"
    result = run_from_repo([sys.executable, "-m", "rlsearch", "train", "--config",
                            "examples/configs/search_grpo_tiny.yaml",
                            f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
                            f"tools.retriever.url={retriever.url}", f"trainer.output_dir={out}",
                            "actor.activation_offload=layer"], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert ("'actor.activation_offload' is layer but the cluster has no GPU: offloading moves activations from GPU "
            "memory to host memory, where a CPU rank keeps them already") in result.stderr
    assert not [path.name for path in (out / "logs").glob("*") if path.name.startswith(("actor-rank", "rollout"))]


def test_a_supervised_run_does_not_retry_bad_input(tmp_path, tiny_model_dir):
    """`--restarts`: bad input stops at once, whether the supervisor finds it (a config key) or its driver does (a
    malformed row, exit status 2): no restart."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "golden_answers": ["a"]}\n{"question": oops\n')
    command = [sys.executable, "-m", "rlsearch", "train", "--restarts", "2", "--config",
               "examples/configs/search_grpo_tiny.yaml", f"model.path={tiny_model_dir}",
               f"trainer.output_dir={tmp_path / 'run'}"]
    for override, expected in (("trainer.total_step=3", "unknown config key 'trainer.total_step'"),
                               (f"data.train_files=[{bad}]", f"{bad}:2: invalid JSON")):
        result = run_from_repo([*command, override], timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        assert expected in result.stderr
        assert "restart" not in result.stdout + result.stderr
    assert not (tmp_path / "run" / "logs" / "restarts.log").exists()


@pytest.mark.memory_heavy
def test_run_search_grpo_script_trains_with_two_tp2_engines_over_broadcast(tmp_path, driver_ray):
    """2 rollout engines x TP2 (4 vLLM workers, nobind threads) on 2 cores; weights reach both engines by the
    broadcast transport (gloo) after every step, and every engine passes the probe check."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = run_search_grpo(out, "rollout.num_engines=2", "rollout.tensor_parallel_size=2",
                             "weights.transport=broadcast", "trainer.total_steps=2", timeout=1200, **driver_ray)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rollout engines: 2 x TP2; engine 0 on node" in result.stdout
    assert "step 2/2 | reward" in result.stdout
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for step in range(2):
        groups = [events.Scalars(f"rollout/engine{engine}/groups")[step].value for engine in (0, 1)]
        assert sum(groups) == 4 and min(groups) >= 1, groups  # batch_size 4: each group on one engine, both used
        tokens = [events.Scalars(f"rollout/engine{engine}/sampled_tokens")[step].value for engine in (0, 1)]
        assert min(tokens) > 0
    assert [e.value for e in events.Scalars("weights/engines")] == [2.0, 2.0]
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4


def test_train_and_eval_run_a_user_agent_through_the_endpoint(tmp_path, driver_ray):
    """`rollout.agent=examples.agents.search_r1:agent`: the agent drives every trajectory through the rollout
    worker's OpenAI-compatible endpoint, in training and in eval; none fails, and what trains is token-exact. The
    actor trains with context parallelism (actor.cp=2: every sequence split over two ranks) and small logit chunks,
    and its synced weights pass the probe check."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    agent = "rollout.agent=examples.agents.search_r1:agent"
    out = tmp_path / "run"
    result = run_search_grpo(out, agent, "actor.cp=2", "actor.logits_chunk_tokens=64", "trainer.total_steps=2",
                             timeout=1200, **driver_ray)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2 | reward" in result.stdout
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("actor/update_ok")] == [1.0, 1.0]
    assert all(e.value > 0 for e in events.Scalars("actor/grad_norm"))
    assert all(e.value > 0.1 for e in events.Scalars("actor/entropy"))
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
    # on-policy: the CP actor's logprobs of the sampled tokens are the engine's
    assert all(e.value < 1e-4 for e in events.Scalars("rollout/actor_logprob_diff_mean"))
    searched = 0
    for step in (1, 2):
        rows = [json.loads(line) for line in (out / "trajectories" / f"step_{step:06d}.jsonl").open()]
        assert len(rows) == 16 and not any(row["failed"] for row in rows)
        for row in rows:
            assert len(row["response_ids"]) == len(row["loss_mask"]) == len(row["rollout_logprobs"])
            assert all(lp == 0.0 for lp, mask in zip(row["rollout_logprobs"], row["loss_mask"]) if not mask)
        searched += sum(len(turn["tool_calls"]) for row in rows for turn in row["turns"])
    assert searched > 0

    evaluated = tmp_path / "eval"
    # the random model answers: its answers start prefilled and their closing tag is biased
    answering = ["rollout.assistant_prefix=<answer>", 'rollout.logit_bias={"</answer>": 12.0}']
    result = run_from_repo(["bash", "examples/run_search_eval.sh", agent, *answering, model_override(),
                            f"output_dir={evaluated}", "eval.max_examples=4"], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (evaluated / "trajectories.jsonl").open()]
    assert len(rows) == 4 and not any(row["failed"] for row in rows)
    # the record's answer is what the agent returned
    answered = [row for row in rows if row["agent_answer"] is not None]
    assert answered and all(row["answer"] == row["agent_answer"] for row in answered), rows


def test_filter_groups_drops_every_group_of_a_random_model_and_the_run_goes_on(tmp_path):
    """`algo.filter_groups=true` on the random-init model: no sample is ever correct (a format bonus may still vary
    the reward), so every group is dropped, the steps take no update and sync nothing, and the run finishes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = run_search_grpo(out, "algo.filter_groups=true", "data.batch_size=2", "data.oversample=1.5",
                             "trainer.total_steps=2", timeout=1200, RLSEARCH_VERBOSE="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # verbose: the libraries print here as they would on their own, and nothing goes to output_dir/logs
    assert "(RolloutWorker pid=" in result.stdout + result.stderr
    assert not (out / "logs").exists()
    for step in (1, 2):
        assert (f"step {step}: all 3 groups had the same outcome for every sample (none correct): nothing to learn "
                "from, no update") in result.stdout
        assert f"step {step}/2 | reward" in result.stdout
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/groups_dropped")] == [(1, 3.0), (2, 3.0)]  # ceil(2*1.5)
    assert [e.value for e in events.Scalars("rollout/groups_kept")] == [0.0, 0.0]
    assert [e.value for e in events.Scalars("actor/updates")] == [0.0, 0.0]
    assert [e.value for e in events.Scalars("weights/engines")] == [0.0, 0.0]  # no new weights, no sync
    assert [e.value for e in events.Scalars("reward/em")] == [0.0, 0.0]
    assert len((out / "trajectories" / "step_000001.jsonl").read_text().splitlines()) == 12  # 3 prompts x 4
    # weights never changed: nothing to checkpoint (an optimizer that never stepped has no state)
    assert "no checkpoint after step 2: no step has updated the weights yet" in result.stdout
    assert not list((out / "checkpoints").glob("step_*"))


def test_icepop_and_turn_credit_train_and_log_what_they_did(tmp_path, tiny_model_dir, toy_data, retriever):
    """`algo.rollout_correction=icepop` with GiGPO's turn credit scored by new_information, and the mismatch gate set
    to warn at any mismatch: two steps train, each warns naming its step, and what the correction and the turn
    scorer did reads back from TensorBoard: in fp32 no trained token masked and each weighted by its r of about 1
    (tests/integration/test_policy_losses.py gives the actor ratios far from 1), the ratio's quantiles in order around
    1, and the turn rewards' mean that of the turns the trajectory records hold."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = run_from_repo([sys.executable, "-m", "rlsearch", "train", "--config",
                            "examples/configs/search_grpo_tiny.yaml", f"model.path={tiny_model_dir}",
                            f"data.train_files=[{toy_data.train}]", f"tools.retriever.url={retriever.url}",
                            f"trainer.output_dir={out}", "trainer.total_steps=2", "data.batch_size=2", SHORT_TURNS,
                            "algo.rollout_correction=icepop", "algo.icepop_low=0.8", "algo.icepop_high=1.5",
                            "algo.advantage=gigpo", "algo.turn_gamma=0.9", "reward.turn_scorer=new_information",
                            "algo.mismatch_threshold=1e-12", "algo.mismatch_action=warn"], timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2 | reward" in result.stdout
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()

    def values(tag: str) -> list[float]:
        assert [e.step for e in events.Scalars(tag)] == [1, 2], tag
        return [e.value for e in events.Scalars(tag)]

    assert values("actor/update_ok") == [1.0, 1.0]
    # every step whose mismatch was not exactly 0 warned (on the tests' CPU it was 3e-7 to 5e-7)
    for step, mismatch in zip((1, 2), values("rollout/actor_logprob_diff_mean")):
        warning = re.search(rf"\[rlsearch\] warning: step {step}: the engine and the actor disagree on the sampled "
                            r"tokens: rollout/actor_logprob_diff_mean \(mean \|log pi_old - log pi_rollout\| per "
                            r"trained token\) is (\S+), above algo\.mismatch_threshold=1e-12\n", result.stdout)
        assert (warning is not None) == (mismatch > 1e-12), result.stdout
        assert warning is None or float(warning.group(1)) == pytest.approx(mismatch, rel=1e-3)
    # fp32 engine and actor: every r lies within 1e-4 of 1, inside [0.8, 1.5], and IcePop weights each token by it
    assert values("actor/correction_masked_fraction") == [0.0, 0.0]
    assert values("actor/tis_weight_mean") == pytest.approx([1.0, 1.0], abs=1e-4)
    assert values("actor/seq_masked_fraction") == [0.0, 0.0]  # a token-level correction masks no sequence
    for low, median, high in zip(*(values(f"rollout/actor_ratio_p{q}") for q in ("01", "50", "99"))):
        assert low <= median <= high and 0.9 < median < 1.1  # fp32 engine and actor: r is about 1
    for step, logged in zip((1, 2), values("reward/turn_reward_mean")):
        rows = [json.loads(line) for line in (out / "trajectories" / f"step_{step:06d}.jsonl").open()]
        rewards = [turn["reward"] for row in rows for turn in row["turns"]]
        assert rows and all(0.0 <= reward <= 1.0 for reward in rewards), rewards
        assert logged == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        for row in rows:  # the first search that brought back words brings nothing seen before
            found = [turn["reward"] for turn in row["turns"]
                     if any(call["ok"] for call in turn["tool_calls"]) and "".join(turn["tool_outputs"]).strip()]
            assert not found or found[0] == 1.0, row["turns"]
