"""Real vLLM engine + real HTTP retriever: trajectories obey the token/mask invariants."""

import ray
from transformers import AutoTokenizer

from tests.integration.rollout_checks import assert_masks_follow_turns, prompt_items, turn_spans


def test_rollout_masks_observations_and_keeps_engine_tokens(rollout_worker, toy_data, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trajectories = ray.get(rollout_worker.generate.remote(prompt_items(toy_data), 1))
    assert len(trajectories) == 8
    calls = [call for t in trajectories for call in t.tool_calls]
    assert len(calls) >= 1 and all(call.ok for call in calls)
    observed = 0
    for t in trajectories:
        assert t.finish_reason in {"answer", "eos", "length", "max_turns"}
        observed += assert_masks_follow_turns(t, tokenizer)
        for turn, model, observation_ids in turn_spans(t, tokenizer):
            assert all(lp <= 0.0 for lp in t.rollout_logprobs[model])
            # the engine's text is cut at the stop string; the last sampled token may extend past it
            assert tokenizer.decode(t.response_ids[model]).startswith(turn.text)
            if model.stop < len(t.response_ids):
                assert tokenizer.decode(observation_ids) == turn.observation
    assert observed >= 1
    # an executed search shows the retrieved passages (possibly none for a junk query), never an error
    executed = [turn for t in trajectories for turn in t.turns if turn.tool_calls]
    assert all(turn.observation.startswith("\n\n<information>") for turn in executed)
    assert not any("Error:" in turn.observation for turn in executed)


def test_fixed_seed_gives_identical_trajectories(rollout_worker, toy_data):
    first = ray.get(rollout_worker.generate.remote(prompt_items(toy_data, prompts=2), 5))
    second = ray.get(rollout_worker.generate.remote(list(reversed(prompt_items(toy_data, prompts=2))), 5))
    by_key = {(t.group_id, t.sample_index): t for t in second}
    for t in first:
        other = by_key[(t.group_id, t.sample_index)]
        assert t.response_ids == other.response_ids
        assert t.rollout_logprobs == other.rollout_logprobs


def test_dead_retriever_becomes_error_observation(rollout_worker, retriever, toy_data):
    retriever.stop()
    try:
        failures_before = ray.get(rollout_worker.tool_stats.remote())["failures"]
        trajectories = ray.get(rollout_worker.generate.remote(prompt_items(toy_data), 1))
        failed = [turn for t in trajectories for turn in t.turns if turn.tool_calls and not turn.tool_calls[0].ok]
        assert failed, "the same seeds made tool calls above; with the server down they must fail"
        assert all(turn.observation.startswith("\n\n<information>Error: search failed:") for turn in failed)
        assert ray.get(rollout_worker.tool_stats.remote())["failures"] > failures_before
    finally:
        retriever.start()  # same port: the worker's client reaches it again
