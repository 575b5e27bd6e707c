"""The algorithm zoo's pure functions against hand-computed values: RLOO, ReMax, REINFORCE++ returns, DAPO's
dynamic-sampling filter and overlong penalty, GSPO's sequence-level ratio, Safe-RLHF's Lagrangian."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rlhf.algos import (
    LagrangeMultiplier,
    combine_advantages,
    discounted_returns,
    groups_with_signal,
    overlong_penalty,
    policy_loss,
    remax_advantages,
    rloo_advantages,
)


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 6.0])  # prompts of 3 samples
    # 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5; ...; 2 - (4+6)/2 = -3; 4 - 4 = 0; 6 - 3 = 3
    assert rloo_advantages(scores, 3).tolist() == [1.0, -0.5, -0.5, -3.0, 0.0, 3.0]
    with pytest.raises(ValueError, match="at least 2 samples"):
        rloo_advantages(scores, 1)


def test_remax_baseline_is_the_greedy_reward_of_the_prompt():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    baseline = torch.tensor([0.25, 1.0])
    assert remax_advantages(scores, baseline, 2).tolist() == [0.75, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match="3 baseline scores for 2 prompts"):
        remax_advantages(scores, torch.zeros(3), 2)


def test_discounted_returns_stop_at_the_response_end():
    rewards = torch.tensor([[0.0, -0.1, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    returns = discounted_returns(rewards, mask, gamma=0.5)
    # row 0: G2 = 1, G1 = -0.1 + 0.5, G0 = 0 + 0.5 * 0.4; padding 0
    torch.testing.assert_close(returns, torch.tensor([[0.2, 0.4, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))


def test_dynamic_sampling_keeps_groups_with_different_scores():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert groups_with_signal(scores, 2).tolist() == [False, True, False]


def test_overlong_penalty_is_zero_then_linear_then_full():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    penalty = overlong_penalty(lengths, max_length=20, buffer=4, factor=1.0)
    assert penalty.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios():
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(2.0), 0.0, math.log(0.5)]], requires_grad=True)  # ratios 2, 1, 0.5; geo mean 1
    advantages = torch.ones(1, 3)
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(new, old, advantages, mask, clip_low=0.2, clip_high=0.2, ratio_level="sequence")
    assert (
        metrics["actor/clip_fraction"] == 0.0
    )  # the sequence ratio (1) is inside the clip range, token ratios are not
    loss.backward()
    # Every token carries the sequence ratio 1 with its own log-prob's gradient: d(-A * s)/d logp_t = -1/3 each.
    torch.testing.assert_close(new.grad, torch.full((1, 3), -1.0 / 3.0))
    token_loss, token_metrics = policy_loss(new.detach(), old, advantages, mask, clip_low=0.2, clip_high=0.2)
    assert token_metrics["actor/clip_fraction"] > 0  # the same ratios clip per token under PPO
    with pytest.raises(ValueError, match="ratio_level='word'"):
        policy_loss(new, old, advantages, mask, clip_low=0.2, clip_high=0.2, ratio_level="word")


def test_safe_rlhf_combined_advantage_and_multiplier_step():
    reward_advantages, cost_advantages = torch.tensor([1.0, -1.0]), torch.tensor([2.0, 0.0])
    # lambda = 1: (A_r - A_c) / 2
    assert combine_advantages(reward_advantages, cost_advantages, 1.0).tolist() == [-0.5, -0.5]
    assert combine_advantages(reward_advantages, cost_advantages, 0.0).tolist() == [1.0, -1.0]
    multiplier = LagrangeMultiplier(value=1.0, lr=0.1, threshold=0.2)
    # cost above the threshold: log lambda += 0.1 * (0.7 - 0.2) -> lambda = e^0.05
    assert multiplier.update(0.7) == pytest.approx(math.exp(0.05))
    before = multiplier.value
    assert multiplier.update(0.0) < before  # below the threshold it falls, and stays positive
    assert multiplier.value > 0
    with pytest.raises(ValueError, match="must be > 0"):
        LagrangeMultiplier(value=0.0, lr=0.1, threshold=0.2)
