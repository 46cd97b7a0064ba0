"""`evaluate`, the hook for periodic evals in training, driving the real vLLM rollout worker (a Ray actor)."""

import json

import ray

from rlsearch.config import EvalConfig, EvalSettings, ModelConfig
from rlsearch.eval import OVERALL, evaluate


def test_evaluate_scores_a_ray_rollout_worker_and_logs_scalars(rollout_worker, toy_data, tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = EvalConfig(
        model=ModelConfig(path=str(tiny_model_dir)), eval=EvalSettings(files=[str(toy_data.test)], max_examples=3),
        output_dir=str(tmp_path / "eval"), log_dir=str(tmp_path / "run"), log_step=7,
    )
    summary = evaluate(lambda items, step: ray.get(rollout_worker.generate.remote(items, step)), config)

    assert summary.metrics[OVERALL]["questions"] == summary.metrics[OVERALL]["samples"] == 3
    records = [json.loads(line) for line in (tmp_path / "eval" / "trajectories.jsonl").open()]
    assert [record["sample_index"] for record in records] == [0, 0, 0]
    assert all(len(record["response_ids"]) == len(record["loss_mask"]) for record in records)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    em = events.Scalars("eval/overall/em")
    assert [(event.step, event.value) for event in em] == [(7, summary.metrics[OVERALL]["em"])]
    assert "eval/toy/tool_calls" in events.Tags()["scalars"]
