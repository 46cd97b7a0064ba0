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


def test_gae_runs_over_each_trajectorys_sampled_tokens_across_its_segments() -> None:
    """The step's per-token estimates (rlsearch.trainer.estimates): GAE of each trajectory over the tokens it sampled,
    its two segments one sequence of steps, the reward on its last sampled token, then whitened over the step."""
    import statistics

    from rlsearch.trainer.estimates import token_estimates
    from rlsearch.trajectory import Segment

    folded, plain, failed = _trajectory(0, 1.0), _trajectory(0, 0.0), _trajectory(0, 1.0)
    folded.earlier_segments = [Segment([1, 2], [30, 31, 32], [1, 0, 1], [-0.1, 0.0, -0.2])]
    failed.failed = "agent: raised"
    trajectories = [folded, failed, plain]
    algo = AlgoConfig(advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    samples = train_samples(trajectories, algo)
    assert len(samples) == 3  # the folded trajectory's two segments, the plain one; not the failed one
    values = [[0.5, 0.0, 0.25], [0.1, 0.2, 0.0, 0.0, 0.0, 0.3], [0.0, 0.5, 0.0, 0.0, 0.0, 1.0]]
    metrics = token_estimates(trajectories, samples, algo, values)
    # lambda = gamma = 1: A_t = R - V_t at every sampled token, the observation tokens 0, across the fold too
    assert samples[0].advantages == pytest.approx([0.5, 0.0, 0.75])
    assert samples[1].advantages == pytest.approx([0.9, 0.8, 0.0, 0.0, 0.0, 0.7])
    assert samples[2].advantages == pytest.approx([0.0, -0.5, 0.0, 0.0, 0.0, -1.0])
    assert samples[1].returns == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0, 1.0]) and samples[1].old_values == values[1]
    trained_values = [0.5, 0.25, 0.1, 0.2, 0.3, 0.0, 0.5, 1.0]
    trained_returns = [1.0] * 5 + [0.0] * 3
    variance = statistics.pvariance
    assert metrics["critic/explained_variance"] == pytest.approx(
        1 - variance([r - v for r, v in zip(trained_returns, trained_values)]) / variance(trained_returns))
    assert metrics["algo/advantage_raw_max"] == pytest.approx(0.9)
    whitened = train_samples(trajectories, AlgoConfig(advantage="gae"))
    token_estimates(trajectories, whitened, AlgoConfig(advantage="gae"), values)
    flat = [a for s in whitened for a, m in zip(s.advantages, s.loss_mask) if m]
    assert statistics.fmean(flat) == pytest.approx(0.0, abs=1e-9) and statistics.stdev(flat) == pytest.approx(1.0)


def test_reinforce_pp_and_rloo_credit_every_sampled_token_of_a_trajectory() -> None:
    from rlsearch.trainer.estimates import token_estimates

    trajectories = [_trajectory(0, 1.0), _trajectory(0, 0.0), _trajectory(0, 0.0)]
    rloo = train_samples(trajectories, AlgoConfig(advantage="rloo"))
    assert [s.advantage for s in rloo] == pytest.approx([1.0, -0.5, -0.5])  # r minus the mean of the others
    algo = AlgoConfig(advantage="reinforce_pp", gamma=0.5)
    samples = train_samples(trajectories, algo)
    token_estimates(trajectories, samples, algo)
    # returns 0.25, 0.5, 1 at the first trajectory's sampled tokens (gamma per sampled token, not per observation),
    # 0 at the others', whitened over the 9 sampled tokens of the step
    raw = [0.25, 0.5, 1.0] + [0.0] * 6
    mean = sum(raw) / 9
    std = (sum((x - mean) ** 2 for x in raw) / 8) ** 0.5
    assert samples[0].advantages == pytest.approx([(0.25 - mean) / std, (0.5 - mean) / std, 0, 0, 0,
                                                   (1.0 - mean) / std], abs=1e-6)
    assert samples[1].advantages[2:5] == [0.0, 0.0, 0.0]  # the observation tokens
