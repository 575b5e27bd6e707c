"""Off-policy importance weights (``algos.off_policy``): truncated and masked IS against hand-computed values, no
gradient through them, weight 1 on policy, and the policy loss weighting each token by them."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rlhf.algos import importance_metrics, importance_weights, policy_loss


def test_truncated_and_masked_weights_follow_the_formulas():
    proximal = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))  # raw ratios 2, 0.5, 9
    truncated, raw = importance_weights(proximal, behaviour, mode="truncated", cap=3.0)
    torch.testing.assert_close(raw, torch.tensor([[2.0, 0.5, 9.0]]))
    torch.testing.assert_close(truncated, torch.tensor([[2.0, 0.5, 3.0]]))
    masked, _ = importance_weights(proximal, behaviour, mode="masked", cap=3.0)
    torch.testing.assert_close(masked, torch.tensor([[2.0, 0.5, 0.0]]))


def test_weights_are_one_on_policy_and_carry_no_gradient():
    log_probs = torch.randn(2, 5, requires_grad=True)
    weights, _ = importance_weights(log_probs, log_probs.detach(), mode="truncated", cap=2.0)
    assert torch.equal(weights, torch.ones(2, 5)) and not weights.requires_grad


def test_bad_mode_or_cap_is_refused():
    with pytest.raises(ValueError, match="choose one of truncated, masked"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), mode="clip", cap=2.0)
    with pytest.raises(ValueError, match="must be > 1"):
        importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), mode="masked", cap=1.0)


def test_metrics_report_the_range_over_response_tokens_only():
    raw = torch.tensor([[0.5, 4.0, 100.0], [1.0, 2.0, 0.01]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    metrics = importance_metrics(raw, mask, cap=3.0)
    assert metrics["off_policy/importance_weight_min"] == 0.5 and metrics["off_policy/importance_weight_max"] == 4.0
    assert metrics["off_policy/beyond_cap_fraction"] == 0.25
    assert math.isclose(metrics["off_policy/importance_weight_mean"], 7.5 / 4)


def test_the_policy_loss_weights_each_token():
    log_probs = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_()
    old = torch.log(torch.tensor([[0.3, 0.6]]))
    advantages, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    weights = torch.tensor([[0.5, 0.0]])
    loss, _ = policy_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.2, token_weights=weights)
    # ratio 1 at the old policy: per-token loss -A; weighted 0.5 * -1 and 0 * 2, token-mean over 2 tokens.
    torch.testing.assert_close(loss, torch.tensor(-0.25))
    loss.backward()
    assert log_probs.grad[0, 1] == 0  # a masked token gives no gradient
    unweighted, _ = policy_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(unweighted, torch.tensor(0.5))
