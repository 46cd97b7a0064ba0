"""Checks of a rollout's trajectories that the protocols' rollout tests share."""

from __future__ import annotations


def assert_masks_follow_turns(trajectory, tokenizer) -> int:
    """Model tokens have mask 1 and engine logprobs, observation tokens are their text's tokenisation with mask 0;
    returns the number of observations."""
    position, observed = 0, 0
    for turn in trajectory.turns:
        assert set(trajectory.loss_mask[position : position + turn.num_tokens]) == {1}
        position += turn.num_tokens
        if position < len(trajectory.response_ids):
            observation_ids = tokenizer.encode(turn.observation, add_special_tokens=False)
            assert trajectory.response_ids[position : position + len(observation_ids)] == observation_ids
            assert set(trajectory.loss_mask[position : position + len(observation_ids)]) == {0}
            assert set(trajectory.rollout_logprobs[position : position + len(observation_ids)]) == {0.0}
            position += len(observation_ids)
            observed += 1
    assert position == len(trajectory.response_ids) == len(trajectory.loss_mask) == len(trajectory.rollout_logprobs)
    return observed
