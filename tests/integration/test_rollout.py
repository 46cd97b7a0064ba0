"""Real vLLM engine + real HTTP retriever: trajectories obey the token/mask invariants."""

import ray
from transformers import AutoTokenizer

from rlsearch.data import load_qa_dataset
from rlsearch.rollout import PromptItem


def _items(toy_data, prompts=4, samples=2):
    examples = load_qa_dataset(toy_data.train)[:prompts]
    return [PromptItem(e.id, e.question, group_id=i, sample_index=s) for i, e in enumerate(examples)
            for s in range(samples)]


def test_rollout_masks_observations_and_keeps_engine_tokens(rollout_worker, toy_data, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trajectories = ray.get(rollout_worker.generate.remote(_items(toy_data), 1))
    assert len(trajectories) == 8
    calls = [call for t in trajectories for call in t.tool_calls]
    assert len(calls) >= 1 and all(call.ok for call in calls)
    observed = 0
    for t in trajectories:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.rollout_logprobs)
        assert t.finish_reason in {"answer", "eos", "length", "max_turns"}
        position = 0
        for turn in t.turns:
            model_ids = t.response_ids[position : position + turn.num_tokens]
            assert set(t.loss_mask[position : position + turn.num_tokens]) == {1}
            assert all(lp <= 0.0 for lp in t.rollout_logprobs[position : position + turn.num_tokens])
            # the engine's text is cut at the stop string; the last sampled token may extend past it
            assert tokenizer.decode(model_ids).startswith(turn.text)
            position += turn.num_tokens
            if position < len(t.response_ids):
                observation_ids = tokenizer.encode(turn.observation, add_special_tokens=False)
                assert t.response_ids[position : position + len(observation_ids)] == observation_ids
                assert set(t.loss_mask[position : position + len(observation_ids)]) == {0}
                assert set(t.rollout_logprobs[position : position + len(observation_ids)]) == {0.0}
                assert tokenizer.decode(observation_ids) == turn.observation
                position += len(observation_ids)
                observed += 1
        assert position == len(t.response_ids)
    assert observed >= 1
    # an executed search shows the retrieved passages (possibly none for a junk query), never an error
    executed = [turn for t in trajectories for turn in t.turns if turn.tool_calls]
    assert all(turn.observation.startswith("\n\n<information>") for turn in executed)
    assert not any("Error:" in turn.observation for turn in executed)


def test_fixed_seed_gives_identical_trajectories(rollout_worker, toy_data):
    first = ray.get(rollout_worker.generate.remote(_items(toy_data, prompts=2), 5))
    second = ray.get(rollout_worker.generate.remote(list(reversed(_items(toy_data, prompts=2))), 5))
    by_key = {(t.group_id, t.sample_index): t for t in second}
    for t in first:
        other = by_key[(t.group_id, t.sample_index)]
        assert t.response_ids == other.response_ids
        assert t.rollout_logprobs == other.rollout_logprobs


def test_dead_retriever_becomes_error_observation(rollout_worker, retriever, toy_data):
    retriever.stop()
    try:
        failures_before = ray.get(rollout_worker.tool_stats.remote())["failures"]
        trajectories = ray.get(rollout_worker.generate.remote(_items(toy_data), 1))
        failed = [turn for t in trajectories for turn in t.turns if turn.tool_calls and not turn.tool_calls[0].ok]
        assert failed, "the same seeds made tool calls above; with the server down they must fail"
        assert all(turn.observation.startswith("\n\n<information>Error: search failed:") for turn in failed)
        assert ray.get(rollout_worker.tool_stats.remote())["failures"] > failures_before
    finally:
        retriever.start()  # same port: the worker's client reaches it again
