"""Checks of a rollout's trajectories that the protocols' rollout tests share, and the prompts they roll out."""

from __future__ import annotations

from collections.abc import Iterator

from rlsearch.data import load_qa_dataset
from rlsearch.rollout import PromptItem


def prompt_items(toy_data, prompts=4, samples=2) -> list[PromptItem]:
    """`samples` samples of each of the first `prompts` train questions of `toy_data`, a group per question."""
    examples = load_qa_dataset(toy_data.train)[:prompts]
    return [PromptItem(e.id, e.question, group_id=i, sample_index=s) for i, e in enumerate(examples)
            for s in range(samples)]


def turn_spans(trajectory, tokenizer) -> Iterator[tuple[object, slice, list[int]]]:
    """Each turn with the span of its model tokens in the response and the tokens of the observation after it
    (none after the last turn)."""
    position = 0
    for turn in trajectory.turns:
        model = slice(position, position + turn.num_tokens)
        position += turn.num_tokens
        observation_ids = []
        if position < len(trajectory.response_ids):
            observation_ids = tokenizer.encode(turn.observation, add_special_tokens=False)
        yield turn, model, observation_ids
        position += len(observation_ids)


def assert_masks_follow_turns(trajectory, tokenizer) -> int:
    """Model tokens have mask 1 and engine logprobs, observation tokens are their text's tokenisation with mask 0;
    returns the number of observations."""
    position, observed = 0, 0
    for _turn, model, observation_ids in turn_spans(trajectory, tokenizer):
        assert set(trajectory.loss_mask[model]) == {1}
        position = model.stop
        if position < len(trajectory.response_ids):
            assert trajectory.response_ids[position : position + len(observation_ids)] == observation_ids
            assert set(trajectory.loss_mask[position : position + len(observation_ids)]) == {0}
            assert set(trajectory.rollout_logprobs[position : position + len(observation_ids)]) == {0.0}
            position += len(observation_ids)
            observed += 1
    assert position == len(trajectory.response_ids) == len(trajectory.loss_mask) == len(trajectory.rollout_logprobs)
    return observed
