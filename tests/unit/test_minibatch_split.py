"""The algorithm's batch decisions on plain data: mini-batch bounds and per-mini-batch loss weights, which groups
algo.filter_groups keeps (by outcome, not shaped reward) and how data.oversample refills the batch, algo.overlong
masking, the objectives the actor runs, and the config checks of the new keys."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlsearch.actor import TrainSample
from rlsearch.algo import groups_with_signal, grpo_objective, minibatch_bounds, sft_objective
from rlsearch.config import AlgoConfig, ConfigError, load_train_config
from rlsearch.rollout import Trajectory
from rlsearch.trainer.step_batch import minibatches, overlong_masked, select_groups, train_samples
from rlsearch.trainer.update import policy_update


def test_minibatch_bounds_are_contiguous_near_equal_and_never_empty():
    assert minibatch_bounds(8, 2) == [(0, 4), (4, 8)]
    assert minibatch_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert minibatch_bounds(2, 4) == [(0, 1), (1, 2)]  # fewer samples than parts: one part per sample
    assert minibatch_bounds(0, 2) == []
    assert minibatch_bounds(5, 1) == [(0, 5)]
    with pytest.raises(ValueError, match="num_minibatches must be >= 1"):
        minibatch_bounds(4, 0)


def _sample(mask: list[int]) -> TrainSample:
    return TrainSample(list(range(len(mask) + 1)), 1, mask, token_weights=[9.0] * len(mask))


def test_each_minibatch_is_normalised_over_its_own_tokens():
    samples = [_sample([1, 1, 0]), _sample([1]), _sample([1, 1, 1, 1]), _sample([0, 1])]
    first, second = minibatches(samples, AlgoConfig(num_minibatches=2))
    assert [s.loss_mask for s in first] == [[1, 1, 0], [1]]
    assert [s.token_weights for s in first] == [pytest.approx([1 / 3, 1 / 3, 0]), pytest.approx([1 / 3])]
    assert [s.token_weights for s in second] == [pytest.approx([0.2] * 4), pytest.approx([0, 0.2])]
    assert samples[0].token_weights == [9.0] * 3  # the step's samples are not modified
    seq = minibatches(samples, AlgoConfig(num_minibatches=2, loss_agg="seq_mean_token_mean"))[1]
    assert [s.token_weights for s in seq] == [pytest.approx([0.125] * 4), pytest.approx([0, 0.5])]
    # one mini-batch: the same weights as over the whole step
    (whole,) = minibatches(samples, AlgoConfig())
    assert sum(sum(s.token_weights) for s in whole) == pytest.approx(1.0)
    assert whole[1].token_weights == pytest.approx([1 / 8])


class _RecordingActor:
    """An actor group stand-in: logprobs -(sample's position), metrics of an update that changed the weights."""

    def __init__(self) -> None:
        self.trained: list[list[TrainSample]] = []

    def compute_logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        return [[-float(index)] * sample.response_len for index, sample in enumerate(samples)]

    def train_step(self, part: list[TrainSample]) -> dict[str, float]:
        self.trained.append(part)
        return {"actor/skipped_nonfinite": 0.0}


def test_old_logprobs_of_several_updates_reach_the_steps_samples_and_their_minibatches():
    """The trajectory records' actor_logprobs are read back from the step's samples after the update."""
    samples = [_sample([1, 1, 0]), _sample([1]), _sample([1, 1, 1, 1]), _sample([0, 1])]
    actor = _RecordingActor()
    policy_update(actor, samples, AlgoConfig(num_minibatches=2))
    expected = [[-0.0] * 3, [-1.0], [-2.0] * 4, [-3.0] * 2]
    assert [s.old_logprobs for s in samples] == expected
    assert [s.old_logprobs for part in actor.trained for s in part] == expected
    single = [_sample([1, 1])]
    policy_update(_RecordingActor(), single, AlgoConfig())
    assert single[0].old_logprobs is None  # one update: on-policy, nothing computed

def _trajectory(
    group_id: int, em: float, reward: float, finish: str = "answer", truncations: tuple[str, ...] = (), **scores: float
) -> Trajectory:
    trajectory = Trajectory(example_id=f"q{group_id}", group_id=group_id, sample_index=0, prompt_ids=[1, 2])
    trajectory.append_model_tokens([10, 11], [-0.5, -0.25])
    trajectory.append_observation_tokens([20])
    trajectory.append_model_tokens([12], [-1.0])
    trajectory.reward, trajectory.finish_reason, trajectory.truncations = reward, finish, list(truncations)
    trajectory.scores = {"em": em, **scores}
    return trajectory


def test_groups_with_signal_keeps_only_mixed_outcomes():
    assert groups_with_signal([1, 1, 0, 0, 1, 0], [0, 0, 1, 1, 2, 2]) == [2]
    assert groups_with_signal([0.0, 1.0, 0.0, 0.0], [5, 5, 3, 3]) == [5]
    assert groups_with_signal([1.0], [0]) == []  # one sample: nothing to compare
    with pytest.raises(ValueError):
        groups_with_signal([1.0], [0, 1])


def test_filter_groups_drops_all_correct_all_wrong_and_format_bonus_only_groups():
    trajectories = [
        _trajectory(0, 1.0, 1.0), _trajectory(0, 1.0, 1.0),  # all correct
        _trajectory(1, 0.0, 0.0), _trajectory(1, 0.0, 0.0),  # all wrong
        _trajectory(2, 0.0, 0.1), _trajectory(2, 0.0, 0.0),  # a format bonus: reward varies, the outcome does not
        _trajectory(3, 1.0, 1.0), _trajectory(3, 0.0, 0.1),  # mixed: kept
    ]
    batch = select_groups(trajectories, AlgoConfig(filter_groups=True), max_groups=4)
    assert [t.group_id for t in batch.trajectories] == [3, 3]
    assert batch.metrics() == {"rollout/groups_kept": 1.0, "rollout/groups_dropped": 3.0,
                               "rollout/groups_trained": 1.0}
    assert batch.describe_dropped() == "1 all correct, 2 none correct"
    unfiltered = select_groups(trajectories, AlgoConfig(), max_groups=4)
    assert len(unfiltered.trajectories) == 8 and unfiltered.groups_dropped == 0


def test_a_judge_score_named_correct_decides_the_outcome():
    trajectories = [_trajectory(0, 0.0, 0.0, correct=1.0), _trajectory(0, 0.0, 0.0, correct=0.0)]
    assert select_groups(trajectories, AlgoConfig(filter_groups=True), 1).groups_kept == 1
    same = [_trajectory(0, 1.0, 1.0, correct=0.0), _trajectory(0, 0.0, 0.0, correct=0.0)]
    assert select_groups(same, AlgoConfig(filter_groups=True), 1).groups_kept == 0


def test_oversampled_groups_fill_the_batch_in_rollout_order():
    # 6 prompts rolled out (batch_size 4, oversample 1.5); groups 1 and 2 are dropped, so 0, 3, 4, 5 train
    trajectories = [t for group in range(6) for t in (
        _trajectory(group, 1.0, 1.0), _trajectory(group, 1.0 if group in (1, 2) else 0.0, 0.0))]
    batch = select_groups(trajectories, AlgoConfig(filter_groups=True), max_groups=4)
    assert sorted({t.group_id for t in batch.trajectories}) == [0, 3, 4, 5]
    assert (batch.groups_kept, batch.groups_dropped, batch.groups_trained) == (4, 2, 4)
    batch = select_groups(trajectories, AlgoConfig(), max_groups=4)
    assert sorted({t.group_id for t in batch.trajectories}) == [0, 1, 2, 3]  # unfiltered: the first 4
    assert (batch.groups_kept, batch.groups_dropped, batch.groups_trained) == (6, 0, 4)


def test_every_group_dropped_leaves_nothing_to_train():
    trajectories = [_trajectory(group, 0.0, 0.1 * sample) for group in range(3) for sample in range(2)]
    batch = select_groups(trajectories, AlgoConfig(filter_groups=True), max_groups=3)
    assert batch.trajectories == [] and batch.groups_dropped == 3
    assert batch.describe_dropped() == "none correct"


def test_failed_trajectories_are_left_out_before_filtering():
    failed = _trajectory(0, 1.0, 1.0)
    failed.failed = "agent raised"
    trajectories = [failed, _trajectory(0, 0.0, 0.0), _trajectory(0, 0.0, 0.0)]
    batch = select_groups(trajectories, AlgoConfig(filter_groups=True), max_groups=1)
    assert batch.trajectories == [] and batch.groups_dropped == 1  # without the failed one all are wrong


def test_overlong_mask_trains_no_token_but_stays_in_the_group_statistics():
    trajectories = [_trajectory(0, 1.0, 1.0, truncations=("tool_output",)),
                    _trajectory(0, 0.0, 0.0, finish="length", truncations=("response_budget",)),
                    _trajectory(0, 0.0, 0.0, finish="max_turns", truncations=("prompt", "max_turns")),
                    _trajectory(0, 0.0, 0.0, finish="eos")]
    masked = train_samples(trajectories, AlgoConfig(overlong="mask"))
    assert [s.loss_mask for s in masked] == [[1, 1, 0, 1], [0] * 4, [0] * 4, [1, 1, 0, 1]]
    assert masked[1].token_weights == [0.0] * 4
    assert masked[0].token_weights == pytest.approx([1 / 6, 1 / 6, 0, 1 / 6])  # over the 6 trained tokens
    # the masked ones still count in the mean and std: 1 right of 4 -> (1 - 0.25) / std([1, 0, 0, 0])
    assert masked[0].advantage == pytest.approx(0.75 / (0.5 + 1e-6))
    assert overlong_masked(trajectories, AlgoConfig(overlong="mask")) == 2
    kept = train_samples(trajectories, AlgoConfig())
    assert [s.loss_mask for s in kept] == [[1, 1, 0, 1]] * 4
    assert [s.advantage for s in kept] == [s.advantage for s in masked]
    assert overlong_masked(trajectories, AlgoConfig()) == 0
    # a cut tool output masks too once it is one of algo.overlong_reasons
    every_cut = AlgoConfig(overlong="mask", overlong_reasons=["response_budget", "max_turns", "tool_output"])
    assert [s.loss_mask for s in train_samples(trajectories, every_cut)] == [[0] * 4] * 3 + [[1, 1, 0, 1]]
    assert overlong_masked(trajectories, every_cut) == 3


def _micro_batch(**tensors) -> SimpleNamespace:
    fields = {"old_logprobs": None, "ref_logprobs": None, "rollout_logprobs": None}
    return SimpleNamespace(**{**fields, **{k: torch.tensor(v) for k, v in tensors.items()}})


def test_grpo_objective_clips_against_old_logprobs_and_weights_tokens():
    logprobs = torch.log(torch.tensor([1.5, 0.5, 1.0])) - 1.0
    batch = _micro_batch(loss_mask=[1.0, 1.0, 0.0], token_weights=[0.5, 0.5, 0.0], advantages=[1.0, -1.0, 1.0],
                         old_logprobs=[-1.0, -1.0, -1.0])
    loss, stats = grpo_objective(logprobs, batch, AlgoConfig(tis_cap=0.0))
    # r = 1.5 with A = 1 is clipped at 1.2; r = 0.5 with A = -1 is clipped at 0.8
    assert loss.item() == pytest.approx(0.5 * -1.2 + 0.5 * 0.8)
    assert stats["clip_tokens"].item() == 2.0 and stats["tokens"].item() == 2.0
    on_policy = SimpleNamespace(**{**vars(batch), "old_logprobs": None})
    _, stats = grpo_objective(logprobs, on_policy, AlgoConfig())
    assert stats["clip_tokens"].item() == 0.0 and stats["approx_kl_sum"].item() == 0.0  # ratio 1


def test_grpo_objective_truncated_importance_weights_use_the_old_policy():
    logprobs = torch.tensor([-1.0], requires_grad=True)
    batch = _micro_batch(loss_mask=[1.0], token_weights=[1.0], advantages=[1.0], old_logprobs=[-2.0],
                         rollout_logprobs=[-2.5])
    loss, stats = grpo_objective(logprobs, batch, AlgoConfig(tis_cap=10.0, clip_ratio_high=100.0))
    tis = torch.exp(torch.tensor(0.5)).item()  # pi_old / pi_rollout, not pi / pi_rollout (that would be e^1.5)
    assert stats["tis_weight_sum"].item() == pytest.approx(tis)
    assert loss.item() == pytest.approx(-torch.exp(torch.tensor(1.0)).item() * tis)
    assert stats["rollout_drift_sum"].item() == pytest.approx(0.5)


def test_sft_objective_is_the_weighted_negative_log_likelihood():
    batch = _micro_batch(loss_mask=[1.0, 0.0, 1.0], token_weights=[0.5, 0.0, 0.5])
    loss, stats = sft_objective(torch.tensor([-1.0, -7.0, -3.0]), batch)
    assert loss.item() == pytest.approx(2.0)
    assert stats["nll_sum"].item() == pytest.approx(4.0) and stats["tokens"].item() == 2.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.num_minibatches=0", r"'algo\.num_minibatches' must be >= 1; got 0"),
        ("algo.ppo_epochs=0", r"'algo\.ppo_epochs' must be >= 1; got 0"),
        ("data.oversample=0.5", r"'data\.oversample' must be >= 1"),
        ("algo.overlong=drop", r"'algo\.overlong' must be one of keep, mask; got 'drop'"),
    ],
)
def test_new_keys_are_validated_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, [override])


def test_new_keys_load_from_overrides():
    config = load_train_config(None, ["algo.num_minibatches=4", "algo.ppo_epochs=2", "algo.filter_groups=true",
                                      "data.oversample=1.5", "algo.overlong=mask"])
    assert (config.algo.num_minibatches, config.algo.ppo_epochs, config.algo.filter_groups) == (4, 2, True)
    assert config.data.oversample == 1.5 and config.algo.overlong == "mask"
    assert replace(config.algo, num_minibatches=1) == replace(AlgoConfig(), ppo_epochs=2, filter_groups=True,
                                                              overlong="mask")
