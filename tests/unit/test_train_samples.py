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


def test_actor_logprobs_and_critic_values_go_back_to_their_trajectory_and_segment() -> None:
    from rlsearch.trainer.step_batch import token_series_of
    from rlsearch.trajectory import Segment

    failed, first, second = _trajectory(0, 0.0), _trajectory(0, 1.0), _trajectory(0, 0.0)
    failed.failed = "agent: raised"
    second.earlier_segments = [Segment([1, 2], [30, 31], [1, 1], [-0.1, -0.2])]
    trajectories = [failed, first, second]
    samples = train_samples(trajectories, AlgoConfig())
    assert token_series_of(trajectories, samples) == {}  # one update a step: the actor computed none
    # the segments of one trajectory share a prefix group (trained as one prefix tree); a lone segment has none
    assert [sample.prefix_group for sample in samples] == [None, 1, 1]
    for index, sample in enumerate(samples):
        sample.old_logprobs = [float(index)] * sample.response_len
    assert token_series_of(trajectories, samples) == {
        id(first): {"actor_logprobs": [[0.0] * 6]},
        id(second): {"actor_logprobs": [[1.0] * 2, [2.0] * 6]},  # earlier segment first, then the trajectory's own
    }
    for index, sample in enumerate(samples):
        sample.old_values = [0.5 * index] * sample.response_len
    assert token_series_of(trajectories, samples)[id(second)]["critic_values"] == [[0.5] * 2, [1.0] * 6]


def _two_turns(reward: float, turn_rewards: list[float], observation: str) -> Trajectory:
    """A search (2 sampled tokens, then 3 observation tokens) and an answer (1 token), each turn with its reward."""
    from rlsearch.trajectory import Turn

    trajectory = _trajectory(0, reward)
    trajectory.turns = [Turn("<search>q</search>", 2, "tool_call", observation=observation, reward=turn_rewards[0]),
                        Turn("<answer>a</answer>", 1, "answer", reward=turn_rewards[1])]
    return trajectory


def test_turn_returns_give_each_turns_tokens_their_turns_advantage() -> None:
    """The first trajectory's search found the answer (turn reward 1) and it answered right (reward 1); the second
    found nothing and answered wrong. Outcome advantages without the std: 0.5 and -0.5; the turn rewards 1, 0, 0, 0
    less their mean 0.25, discounted at 0.5 from each turn on: 0.625, -0.25 and -0.375, -0.25."""
    trajectories = [_two_turns(1.0, [1.0, 0.0], "docs A"), _two_turns(0.0, [0.0, 0.0], "docs B")]
    algo = AlgoConfig(advantage="turn_returns", turn_gamma=0.5, norm_adv_by_std=False)
    first, second = train_samples(trajectories, algo)
    # the search's two sampled tokens and the observation after them take its advantage; the answer token its own
    assert first.advantages == pytest.approx([1.125] * 5 + [0.25], abs=1e-6)
    assert second.advantages == pytest.approx([-0.875] * 5 + [-0.75], abs=1e-6)
    assert (first.advantage, second.advantage) == (0.5, -0.5)  # the outcome advantages stay
    assert first.loss_mask == [1, 1, 0, 0, 0, 1]  # observation tokens stay masked
    assert all(sample.advantages is None for sample in train_samples(trajectories, AlgoConfig()))  # the default


def test_gigpo_compares_turns_that_saw_the_same_observations() -> None:
    """Returns with the reward at the last turn (gamma 0.5): 1.5, 1 and 0, 0. Both first turns start from the prompt:
    mean 0.75, so +0.75 and -0.75. Their second turns saw other tool outputs, so each is alone in its state: 0."""
    algo = AlgoConfig(advantage="gigpo", turn_gamma=0.5, norm_adv_by_std=False)
    first, second = train_samples([_two_turns(1.0, [1.0, 0.0], "docs A"), _two_turns(0.0, [0.0, 0.0], "docs B")], algo)
    assert first.advantages == pytest.approx([1.25] * 5 + [0.5], abs=1e-6)
    assert second.advantages == pytest.approx([-1.25] * 5 + [-0.5], abs=1e-6)
    # the same tool output: the second turns share a state too, and their returns 1 and 0 are compared
    first, second = train_samples([_two_turns(1.0, [1.0, 0.0], "docs A"), _two_turns(0.0, [0.0, 0.0], "docs A")], algo)
    assert first.advantages == pytest.approx([1.25] * 5 + [1.0], abs=1e-6)
    assert second.advantages == pytest.approx([-1.25] * 5 + [-1.0], abs=1e-6)


def test_turn_advantages_follow_a_folded_trajectorys_turns_over_its_segments() -> None:
    from rlsearch.trainer.step_batch import token_advantages
    from rlsearch.trajectory import Segment, Turn

    folded = _trajectory(0, 1.0)
    # the search and its observation in the first segment, the answer's 2 tokens in the second
    folded.earlier_segments = [Segment([1, 2], [30, 31, 40], [1, 1, 0], [-0.1, -0.2, 0.0])]
    folded.response_ids, folded.loss_mask, folded.rollout_logprobs = [12, 13], [1, 1], [-0.5, -0.5]
    folded.turns = [Turn("s", 2, "tool_call"), Turn("a", 2, "answer")]
    assert token_advantages(folded, [0.75, -0.25], 0.1) == [[0.75, 0.75, 0.75], [-0.25, -0.25]]
    folded.turns = []  # no turns recorded: the outcome advantage everywhere
    assert token_advantages(folded, [], 0.1) == [[0.1] * 3, [0.1] * 2]


def test_turn_credit_needs_the_turns_scored() -> None:
    unscored = _two_turns(1.0, [1.0, 0.0], "docs A")
    unscored.turns[1].reward = None
    with pytest.raises(ValueError, match=r"algo\.advantage=gigpo needs every turn's reward"):
        train_samples([unscored, _two_turns(0.0, [0.0, 0.0], "docs B")], AlgoConfig(advantage="gigpo"))


def test_the_samples_of_one_grpo_group_share_a_prompt_group() -> None:
    trajectories = [_trajectory(7, 1.0), _trajectory(3, 0.0), _trajectory(7, 0.0), _trajectory(3, 1.0)]
    trajectories[1].earlier_segments = [trajectories[1].segments[0]]  # a two-segment trajectory: both in group 3's
    samples = train_samples(trajectories, AlgoConfig())
    assert [sample.prompt_group for sample in samples] == [0, 1, 1, 0, 1]
    assert [sample.prefix_group for sample in samples] == [None, 1, 1, None, None]
