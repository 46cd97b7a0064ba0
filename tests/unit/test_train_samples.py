"""What the trainer hands the actor: advantages per group, token weights over the trained tokens, and the
observation-masking switch (algo.mask_observations, the Search-R1 ablation)."""

from __future__ import annotations

import pytest

from rlsearch.config import AlgoConfig
from rlsearch.rollout import Trajectory
from rlsearch.trainer.step_batch import train_samples


def _trajectory(group_id: int, reward: float) -> Trajectory:
    trajectory = Trajectory(example_id=f"q{group_id}", group_id=group_id, sample_index=0, prompt_ids=[1, 2, 3])
    trajectory.append_model_tokens([10, 11], [-0.5, -0.25])
    trajectory.append_observation_tokens([20, 21, 22])
    trajectory.append_model_tokens([12], [-1.0])
    trajectory.reward = reward
    return trajectory


def test_observation_tokens_are_masked_by_default() -> None:
    samples = train_samples([_trajectory(0, 1.0), _trajectory(0, 0.0)], AlgoConfig())
    first, second = samples
    assert first.token_ids == [1, 2, 3, 10, 11, 20, 21, 22, 12] and first.response_start == 3
    assert first.loss_mask == [1, 1, 0, 0, 0, 1]
    assert first.token_weights == pytest.approx([1 / 6, 1 / 6, 0, 0, 0, 1 / 6])  # token_mean over 6 sampled tokens
    assert first.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert first.advantage == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6))  # (r - mean) / (sample std + eps)
    assert second.advantage == pytest.approx(-first.advantage)


def test_unmasked_observations_train_every_response_token() -> None:
    samples = train_samples([_trajectory(0, 1.0), _trajectory(0, 0.0)], AlgoConfig(mask_observations=False))
    for sample in samples:
        assert sample.loss_mask == [1] * 6
        assert sample.token_weights == pytest.approx([1 / 12] * 6)
        assert sample.rollout_logprobs is None  # tool tokens were never sampled: no importance weights for them


def test_actor_logprobs_go_back_to_their_trajectory_and_segment() -> None:
    from rlsearch.trainer.step_batch import actor_logprobs_of
    from rlsearch.trajectory import Segment

    failed, first, second = _trajectory(0, 0.0), _trajectory(0, 1.0), _trajectory(0, 0.0)
    failed.failed = "agent: raised"
    second.earlier_segments = [Segment([1, 2], [30, 31], [1, 1], [-0.1, -0.2])]
    trajectories = [failed, first, second]
    samples = train_samples(trajectories, AlgoConfig())
    assert actor_logprobs_of(trajectories, samples) == {}  # one update a step: the actor computed none
    # the segments of one trajectory share a prefix group (trained as one prefix tree); a lone segment has none
    assert [sample.prefix_group for sample in samples] == [None, 1, 1]
    for index, sample in enumerate(samples):
        sample.old_logprobs = [float(index)] * sample.response_len
    assert actor_logprobs_of(trajectories, samples) == {
        id(first): [[0.0] * 6],
        id(second): [[1.0] * 2, [2.0] * 6],  # earlier segment first, then the trajectory's own tokens
    }
