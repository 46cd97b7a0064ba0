"""The policy losses (PPO-clip, GSPO, CISPO, MiniRL), the value loss, seq_mean_token_sum weights, the GRPO objective's
dispatch and ratio base, and the critic's objective and metrics, against values and gradients worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlsearch.algo import (
    cispo_terms,
    critic_objective,
    explained_variance,
    grpo_objective,
    gspo_terms,
    loss_token_weights,
    minirl_terms,
    ppo_clip_terms,
    value_loss_terms,
    value_metrics,
)
from rlsearch.config import AlgoConfig, CriticConfig


def _logprobs(ratios: list[float]) -> torch.Tensor:
    """Leaf logprobs log(r) against old logprobs 0, so that the ratio of each token is the given one."""
    return torch.log(torch.tensor(ratios)).requires_grad_()


def _grad(per_token_loss: torch.Tensor, logprobs: torch.Tensor, weights: torch.Tensor | None = None) -> list[float]:
    total = per_token_loss.sum() if weights is None else (per_token_loss * weights).sum()
    (grad,) = torch.autograd.grad(total, logprobs)
    return grad.tolist()


def test_minirl_masks_out_of_band_tokens_on_the_side_the_advantage_pushes():
    logprobs = _logprobs([1.5, 0.5, 1.1, 0.9, 1.5])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0])
    terms = minirl_terms(logprobs, torch.zeros(5), advantages, clip_low=0.2, clip_high=0.2)
    # masked: r 1.5 > 1.2 with A > 0; r 0.5 < 0.8 with A < 0. r 1.5 with A < 0 is kept (PPO's max keeps it too)
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    # -r A log r: -1.1 log 1.1 = -0.1048412; 0.9 log 0.9 = -0.0948245; 1.5 log 1.5 = 0.6081977
    assert terms.per_token_loss.tolist() == pytest.approx([0.0, 0.0, -0.1048412, -0.0948245, 0.6081977], abs=1e-6)
    assert _grad(terms.per_token_loss, logprobs) == pytest.approx([0.0, 0.0, -1.1, 0.9, 1.5], abs=1e-6)


def test_minirl_gradient_is_ppo_clip_gradient_on_random_tokens():
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(256, generator=generator) * 3
    logprobs = (old + torch.randn(256, generator=generator) * 0.3).requires_grad_()
    advantages = torch.randn(256, generator=generator)
    weights = torch.rand(256, generator=generator)
    minirl = minirl_terms(logprobs, old, advantages, 0.2, 0.3)
    ppo = ppo_clip_terms(logprobs, old, advantages, 0.2, 0.3)
    assert 20 < ppo.clipped.sum().item() < 200  # both branches are exercised
    assert torch.equal(minirl.clipped, ppo.clipped)
    assert _grad(minirl.per_token_loss, logprobs, weights) == pytest.approx(
        _grad(ppo.per_token_loss, logprobs, weights), abs=1e-6)
    assert not torch.allclose(minirl.per_token_loss, ppo.per_token_loss)  # the values differ


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    logprobs = _logprobs([1.5, 0.5, 1.1])
    advantages = torch.tensor([1.0, -1.0, 1.0])
    terms = cispo_terms(logprobs, torch.zeros(3), advantages, clip_high=0.2)
    # weights sg(min(r, 1.2)) = 1.2, 0.5, 1.1; loss -w A log r = -1.2 log 1.5, 0.5 log 0.5, -1.1 log 1.1
    assert terms.per_token_loss.tolist() == pytest.approx([-0.4865581, -0.3465736, -0.1048412], abs=1e-6)
    assert terms.clipped.tolist() == [1.0, 0.0, 0.0]  # no lower bound: r = 0.5 is not clipped
    assert _grad(terms.per_token_loss, logprobs) == pytest.approx([-1.2, 0.5, -1.1], abs=1e-6)
    # PPO-clip gives the first two tokens no gradient (r = 1.5 above 1.2 with A > 0, r = 0.5 below 0.8 with A < 0)
    ppo = ppo_clip_terms(logprobs, torch.zeros(3), advantages, 0.2, 0.2)
    assert _grad(ppo.per_token_loss, logprobs) == pytest.approx([0.0, 0.0, -1.1], abs=1e-6)


# GSPO: two sequences of 2 and 3 positions, the middle one of the second an observation (mask 0, its log r of 5 never
# counted). Mean log r over the trained tokens: (0.1 + 0.3) / 2 = 0.2 and (-0.2 - 0.4) / 2 = -0.3
GSPO_LOG_R = [0.1, 0.3, -0.2, 5.0, -0.4]
GSPO_MASK = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
GSPO_ADV = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
S0, S1 = math.exp(0.2), math.exp(-0.3)  # 1.2214028, 0.7408182


def _gspo(clip: float):
    logprobs = torch.tensor(GSPO_LOG_R, requires_grad=True)
    terms = gspo_terms(logprobs, torch.zeros(5), GSPO_ADV, GSPO_MASK, [2, 3], clip, clip)
    return logprobs, terms


def test_gspo_ratio_is_per_sequence_and_its_gradient_the_tokens_own():
    logprobs, terms = _gspo(clip=0.5)
    assert terms.ratio.tolist() == pytest.approx([S0, S0, S1, S1, S1], abs=1e-6)
    assert terms.per_token_loss.tolist() == pytest.approx([-S0, -S0, S1, S1, S1], abs=1e-6)
    assert terms.clipped.tolist() == [0.0] * 5
    # d(-A s_it)/d log pi_t = -A s_i, its own token only (the sequence part is detached)
    assert _grad(terms.per_token_loss, logprobs, GSPO_MASK) == pytest.approx([-S0, -S0, S1, 0.0, S1], abs=1e-6)


def test_gspo_token_with_sequence_mean_weights_is_gspo_sequence_gradient():
    # GSPO proper: loss = mean_i -A_i s_i, s_i = exp(mean log r): d/d log pi_t = -A_i s_i / |y_i| / 2
    logprobs, terms = _gspo(clip=0.5)
    weights = torch.tensor([0.25, 0.25, 0.25, 0.0, 0.25])  # seq_mean_token_mean: 1 / (2 tokens x 2 sequences)
    assert _grad(terms.per_token_loss, logprobs, weights) == pytest.approx(
        [-S0 / 4, -S0 / 4, S1 / 4, 0.0, S1 / 4], abs=1e-6)


def test_gspo_clips_whole_sequences():
    logprobs, terms = _gspo(clip=0.1)
    # s_0 = 1.22 > 1.1 with A > 0 and s_1 = 0.74 < 0.9 with A < 0: both clipped to the bound, no gradient
    assert terms.per_token_loss.tolist() == pytest.approx([-1.1, -1.1, 0.9, 0.9, 0.9], abs=1e-6)
    assert terms.clipped.tolist() == [1.0] * 5
    assert _grad(terms.per_token_loss, logprobs, GSPO_MASK) == [0.0] * 5


def test_value_loss_clipped_and_plain():
    values = torch.tensor([1.0, 2.0, 1.0], requires_grad=True)
    old_values, returns = torch.tensor([0.8, 1.0, 0.0]), torch.tensor([1.5, 1.0, 1.0])
    terms = value_loss_terms(values, old_values, returns, clip=0.5)
    # 0: V inside [0.3, 1.3]: 0.5 x 0.5^2 = 0.125 either way; 1: 0.5 x 1^2 = 0.5 beats the clipped V 1.5's 0.125;
    # 2: V = 1 = R gives 0, the clipped V 0.5 gives 0.5 x 0.5^2 = 0.125 (clipped, no gradient)
    assert terms.per_token_loss.tolist() == pytest.approx([0.125, 0.5, 0.125], abs=1e-6)
    assert terms.clipped.tolist() == [0.0, 0.0, 1.0]
    assert _grad(terms.per_token_loss, values) == pytest.approx([-0.5, 1.0, 0.0], abs=1e-6)  # V - R
    plain = value_loss_terms(values, old_values, returns, clip=0.0)
    assert plain.per_token_loss.tolist() == pytest.approx([0.125, 0.5, 0.0], abs=1e-6)
    assert plain.clipped.tolist() == [0.0] * 3
    assert _grad(plain.per_token_loss, values) == pytest.approx([-0.5, 1.0, 0.0], abs=1e-6)


def test_seq_mean_token_sum_weights():
    masks = [[0, 1, 1, 0], [1, 1, 1], [0, 0]]
    weights = loss_token_weights(masks, "seq_mean_token_sum")
    assert weights == [[0.0, 0.5, 0.5, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0]]  # two sequences with a trained token
    # the aggregate is the mean over sequences of each one's token sum, whatever the split: (1 + 2) + (3 + 4 + 5) / 2
    losses = [[9.0, 1.0, 2.0, 9.0], [3.0, 4.0, 5.0], [9.0, 9.0]]
    parts = [sum(w * x for w, x in zip(ws, xs)) for ws, xs in zip(weights, losses)]
    assert sum(parts) == pytest.approx(7.5)
    assert loss_token_weights([[0, 0]], "seq_mean_token_sum") == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="seq_mean_token_sum"):
        loss_token_weights(masks, "token_sum")


def _policy_batch(**overrides) -> SimpleNamespace:
    # three trained tokens and an observation; pi_old = pi (the current policy), the engine's logprobs lower by
    # log 1.5, log 1 and log 0.5 at the trained tokens
    fields = dict(
        loss_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]), token_weights=torch.tensor([1 / 3, 1 / 3, 0.0, 1 / 3]),
        advantages=torch.tensor([1.0, 1.0, 1.0, 1.0]), old_logprobs=None, ref_logprobs=None,
        rollout_logprobs=torch.tensor([-1.0 - math.log(1.5), -2.0, 0.0, -1.0 - math.log(0.5)]), response_lens=[4],
    )
    return SimpleNamespace(**{**fields, **overrides})


def _grpo(**algo) -> tuple[float, list[float], dict[str, float]]:
    logprobs = torch.tensor([-1.0, -2.0, -3.0, -1.0], requires_grad=True)
    loss, stats = grpo_objective(logprobs, _policy_batch(), AlgoConfig(**algo))
    loss.backward()
    return loss.item(), logprobs.grad.tolist(), {key: value.item() for key, value in stats.items()}


def test_grpo_objective_ratio_against_the_rollout():
    # r = 1.5, 1, 0.5 against the engine; PPO-clip at 0.2 with A = 1: -1.2 (clipped), -1, -0.5, a third each
    loss, grad, stats = _grpo(ratio_against="rollout")
    assert loss == pytest.approx(-(1.2 + 1.0 + 0.5) / 3, abs=1e-6)
    assert grad == pytest.approx([0.0, -1.0 / 3, 0.0, -0.5 / 3], abs=1e-6)
    assert stats["clip_tokens"] == 1.0
    assert stats["tis_weight_sum"] == pytest.approx(3.0)  # the correction sees r = 1: every weight 1
    # the mismatch metric still measures the actor's old policy against the engine: |log 1.5| + 0 + |log 0.5|
    assert stats["rollout_drift_sum"] == pytest.approx(math.log(1.5) + math.log(2.0), abs=1e-6)
    # against the actor's old policy the ratio is 1: loss -1, and token TIS weights min(r, 2) = 1.5, 1, 0.5
    loss, grad, stats = _grpo(ratio_against="old")
    assert loss == pytest.approx(-1.0, abs=1e-6)
    assert grad == pytest.approx([-1.5 / 3, -1.0 / 3, 0.0, -0.5 / 3], abs=1e-6)
    assert stats["clip_tokens"] == 0.0 and stats["tis_weight_sum"] == pytest.approx(3.0, abs=1e-6)
    with pytest.raises(ValueError, match="ratio_against=rollout"):
        grpo_objective(torch.zeros(4), _policy_batch(rollout_logprobs=None), AlgoConfig(ratio_against="rollout"))


def test_grpo_objective_dispatches_on_the_policy_loss():
    # minirl against the rollout: -sg(r) A log pi over the unmasked tokens, r = 1.5 masked (above 1.3):
    # (-(1 x -2) - 0.5 x -1) / 3 = 2.5 / 3; gradient -r A / 3 as PPO-clip's at clip_ratio_high 0.3
    loss, grad, stats = _grpo(policy_loss="minirl", ratio_against="rollout", clip_ratio_high=0.3)
    assert loss == pytest.approx(2.5 / 3, abs=1e-6)
    assert grad == pytest.approx([0.0, -1.0 / 3, 0.0, -0.5 / 3], abs=1e-6)
    assert stats["clip_tokens"] == 1.0
    # cispo: weights min(r, 1.2) = 1.2, 1, 0.5 times -A log pi: (1.2 + 2 + 0.5) / 3; every token keeps a gradient
    loss, grad, _ = _grpo(policy_loss="cispo", ratio_against="rollout")
    assert loss == pytest.approx(3.7 / 3, abs=1e-6)
    assert grad == pytest.approx([-1.2 / 3, -1.0 / 3, 0.0, -0.5 / 3], abs=1e-6)
    # gspo: the one sequence's ratio exp((log 1.5 + 0 + log 0.5) / 3) = 0.9085603, inside its band [0.5, 1.5]
    loss, grad, _ = _grpo(policy_loss="gspo", ratio_against="rollout", gspo_clip_low=0.5, gspo_clip_high=0.5)
    s = math.exp((math.log(1.5) + math.log(0.5)) / 3)
    assert loss == pytest.approx(-s, abs=1e-6)
    assert grad == pytest.approx([-s / 3, -s / 3, 0.0, -s / 3], abs=1e-6)


def test_kl_enters_the_loss_only_with_kl_penalty_loss():
    ref = torch.tensor([-1.5, -2.0, 0.0, -1.0])  # k1 = 0.5, 0, -, 0 at the trained tokens
    batch = _policy_batch(ref_logprobs=ref)
    logprobs = torch.tensor([-1.0, -2.0, -3.0, -1.0])
    in_loss = grpo_objective(logprobs, batch, AlgoConfig(kl_coef=0.1, kl_estimator="k1"))[1]
    assert in_loss["kl_loss"].item() == pytest.approx(0.5 / 3, abs=1e-6)
    in_reward = grpo_objective(logprobs, batch, AlgoConfig(kl_coef=0.1, kl_estimator="k1", kl_penalty="reward"))[1]
    assert in_reward["kl_loss"].item() == 0.0
    assert in_reward["loss"].item() == pytest.approx(in_loss["loss"].item() - 0.1 * 0.5 / 3, abs=1e-6)


def _value_batch(values, mask, returns, old_values) -> tuple[torch.Tensor, SimpleNamespace]:
    mask = torch.tensor(mask)
    return torch.tensor(values, requires_grad=True), SimpleNamespace(
        loss_mask=mask, token_weights=mask / 3, returns=torch.tensor(returns), old_values=torch.tensor(old_values))


def test_critic_objective_sums_and_value_metrics():
    # the value-loss case above, plus a padding position (mask 0) whose numbers must not count
    values, batch = _value_batch([1.0, 2.0, 1.0, 3.0], [1.0, 1.0, 1.0, 0.0], [1.5, 1.0, 1.0, 9.0], [0.8, 1.0, 0.0, 3.0])
    loss, stats = critic_objective(values, batch, CriticConfig(value_clip=0.5))
    assert loss.item() == pytest.approx((0.125 + 0.5 + 0.125) / 3, abs=1e-6)
    loss.backward()
    assert values.grad.tolist() == pytest.approx([-0.5 / 3, 1.0 / 3, 0.0, 0.0], abs=1e-6)
    stats = {key: value.item() for key, value in stats.items()}
    # R - V = 0.5, -1, 0
    assert stats == pytest.approx({
        "loss": 0.25, "value_loss": 0.25, "value_clip_tokens": 1.0, "tokens": 3.0, "value_sum": 4.0,
        "return_sum": 3.5, "return_sq_sum": 4.25, "error_sum": -0.5, "error_sq_sum": 1.25}, abs=1e-6)
    metrics = value_metrics(stats)
    # Var(R) = 4.25/3 - (3.5/3)^2 = 1/18; Var(R - V) = 1.25/3 - (0.5/3)^2 = 7/18; 1 - 7 = -6
    assert metrics == pytest.approx({
        "critic/value_loss": 0.25, "critic/value_clip_fraction": 1 / 3, "critic/explained_variance": -6.0,
        "critic/value_mean": 4 / 3, "critic/return_mean": 3.5 / 3}, abs=1e-6)
    assert metrics["critic/explained_variance"] == pytest.approx(
        explained_variance([1.0, 2.0, 1.0], [1.5, 1.0, 1.0]), abs=1e-9)


def test_value_metrics_add_over_micro_batches():
    generator = torch.Generator().manual_seed(1)
    values, returns = torch.randn(10, generator=generator), torch.randn(10, generator=generator)
    summed: dict[str, float] = {}
    for part in (slice(0, 4), slice(4, 10)):
        _, stats = critic_objective(values[part], SimpleNamespace(
            loss_mask=torch.ones(part.stop - part.start), token_weights=torch.full((part.stop - part.start,), 0.1),
            returns=returns[part], old_values=values[part]), CriticConfig(value_clip=0.0))
        for key, value in stats.items():
            summed[key] = summed.get(key, 0.0) + value.item()
    metrics = value_metrics(summed)
    assert metrics["critic/explained_variance"] == pytest.approx(explained_variance(values, returns), abs=1e-6)
    assert metrics["critic/value_loss"] == pytest.approx(0.05 * (values - returns).square().sum().item(), abs=1e-6)
    equal = value_metrics({**summed, "return_sum": 5.0, "return_sq_sum": 2.5})  # ten returns of 0.5
    assert math.isnan(equal["critic/explained_variance"])
