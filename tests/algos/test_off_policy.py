"""Rollout correction (``algos.off_policy``): token, sequence and geometric importance weights, truncation, token and
sequence rejection, the veto, against hand-computed values; no gradient through them; nothing changes on policy; the
metrics' sums; and the policy loss weighting each token by them."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rlhf.algos import Correction, correct, correction_metrics, policy_loss
from spmd_rlhf.algos.off_policy import SUMMED


def log(*values: float) -> torch.Tensor:
    return torch.log(torch.tensor([values]))


def two_rows(first: list[float], second: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Proximal log-probs whose ratios to a uniform behaviour (log 1 = 0) are ``first`` and ``second`` (0: padding),
    and their mask."""
    ratios = torch.tensor([first, second])
    mask = (ratios > 0).float()
    return torch.log(torch.where(mask.bool(), ratios, 1.0)), mask


def test_token_weights_are_truncated_at_the_threshold_and_zero_past_the_response():
    proximal, mask = two_rows([1.5, 3.0, 0.5], [1.0, 1.0, 0.0])
    corrected = correct(proximal, torch.zeros_like(proximal), mask, Correction(is_level="token", is_threshold=2.0))
    torch.testing.assert_close(corrected.weights, torch.tensor([[1.5, 2.0, 0.5], [1.0, 1.0, 0.0]]))
    assert torch.equal(corrected.loss_mask, mask.bool())
    assert corrected.metrics["truncated_tokens"] == 1 and corrected.metrics["rejected_tokens"] == 0
    assert math.isclose(corrected.metrics["weight_max"], 3.0, rel_tol=1e-6)  # before truncation
    assert math.isclose(corrected.metrics["weight_min"], 0.5, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        # Row 0: token ratios 2 and 1.5 (product 3, geometric mean sqrt 3); row 1: 0.5, 0.5, 2 (product 0.5).
        ("sequence", [[2.0, 2.0, 0.0], [0.5, 0.5, 0.5]]),
        ("geometric", [[math.sqrt(3), math.sqrt(3), 0.0], [0.5 ** (1 / 3)] * 3]),
    ],
)
def test_sequence_and_geometric_weights_are_one_per_response(level, expected):
    proximal, mask = two_rows([2.0, 1.5, 0.0], [0.5, 0.5, 2.0])
    corrected = correct(proximal, torch.zeros_like(proximal), mask, Correction(is_level=level, is_threshold=2.0))
    torch.testing.assert_close(corrected.weights, torch.tensor(expected))


def test_token_rejection_drops_the_tokens_outside_the_bounds_and_keeps_the_rest():
    proximal, mask = two_rows([1.5, 3.0, 0.4], [1.0, 0.6, 0.0])
    correction = Correction(is_level=None, rs_level="token", rs_upper=2.0, rs_lower=0.5)
    corrected = correct(proximal, torch.zeros_like(proximal), mask, correction)
    assert corrected.loss_mask.tolist() == [[True, False, False], [True, True, False]]
    assert corrected.weights.tolist() == corrected.loss_mask.float().tolist()  # no importance weights
    assert corrected.metrics["rejected_tokens"] == 2 and corrected.metrics["rejected_sequences"] == 0


@pytest.mark.parametrize(
    ("level", "upper", "lower", "kept_rows"),
    [
        ("sequence", 2.0, 0.5, [False, True]),  # products 3 and 1.2
        ("geometric", 1.2, 1 / 1.2, [False, True]),  # geometric means 1.73 and 1.1
        ("geometric", 2.0, 0.5, [True, True]),
    ],
)
def test_sequence_rejection_drops_whole_responses(level, upper, lower, kept_rows):
    proximal, mask = two_rows([3.0, 1.0, 0.0], [1.2, 1.0, 1.0])
    correction = Correction(is_level=None, rs_level=level, rs_upper=upper, rs_lower=lower)
    corrected = correct(proximal, torch.zeros_like(proximal), mask, correction)
    assert corrected.loss_mask.any(dim=1).tolist() == kept_rows
    assert torch.equal(corrected.loss_mask[1], mask[1].bool())
    assert corrected.metrics["rejected_sequences"] == kept_rows.count(False)


def test_the_veto_rejects_a_response_with_one_catastrophic_token():
    proximal, mask = two_rows([1.0, 1e-5, 1.0], [0.9, 1.1, 0.0])
    correction = Correction(is_level="token", veto_threshold=1e-4)
    corrected = correct(proximal, torch.zeros_like(proximal), mask, correction)
    assert corrected.loss_mask.tolist() == [[False, False, False], [True, True, False]]
    assert corrected.weights[0].tolist() == [0.0, 0.0, 0.0]
    assert corrected.metrics["vetoed_sequences"] == 1 and corrected.metrics["rejected_sequences"] == 1


def test_no_gradient_flows_through_the_weights_and_on_policy_nothing_changes():
    log_probs = log(0.5, 0.2, 0.9).requires_grad_()
    mask = torch.ones(1, 3)
    for correction in (Correction(), Correction(is_level="sequence", rs_level="geometric", rs_upper=1.001)):
        corrected = correct(log_probs, log_probs.detach(), mask, correction)
        assert not corrected.weights.requires_grad
        assert corrected.weights.tolist() == [[1.0, 1.0, 1.0]] and corrected.loss_mask.all()


def test_the_metrics_combine_over_ranks_as_sums_and_extremes():
    proximal, mask = two_rows([1.5, 3.0, 0.5], [1.0, 1.0, 0.0])
    corrected = correct(proximal, torch.zeros_like(proximal), mask, Correction(rs_level="token", rs_upper=2.5))
    sums = {key: float(corrected.metrics[key]) for key in SUMMED}
    metrics = correction_metrics(sums, float(corrected.metrics["weight_min"]), float(corrected.metrics["weight_max"]))
    gaps = [math.log(1.5), math.log(3.0), math.log(0.5), 0.0, 0.0]
    assert math.isclose(metrics["off_policy/log_prob_gap_mean"], sum(gaps) / 5, rel_tol=1e-6)
    k3 = sum(math.exp(gap) - 1 - gap for gap in gaps) / 5
    assert math.isclose(metrics["off_policy/kl_k3"], k3, rel_tol=1e-6)
    assert math.isclose(metrics["off_policy/importance_weight_mean"], 7.0 / 5, rel_tol=1e-6)
    assert metrics["off_policy/rejected_token_fraction"] == 0.2  # the 3.0 token: above rs_upper
    assert metrics["off_policy/truncated_token_fraction"] == 0.0  # the truncated one was rejected
    assert metrics["off_policy/rejected_sequence_fraction"] == 0.0


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="is_level='tok' is unknown"):
        Correction(is_level="tok")
    with pytest.raises(ValueError, match="must hold 1 inside them"):
        Correction(rs_level="token", rs_upper=0.9)


def test_the_policy_loss_weights_each_token():
    log_probs = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_()
    old = torch.log(torch.tensor([[0.3, 0.6]]))
    advantages, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    weights = torch.tensor([[0.5, 0.0]])
    loss, _ = policy_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.2, token_weights=weights)
    # ratio 1 at the old policy: per-token loss -A; weighted 0.5 * -1 and 0 * 2, token-mean over 2 tokens.
    torch.testing.assert_close(loss, torch.tensor(-0.25))
    loss.backward()
    assert log_probs.grad[0, 1] == 0  # a zero weight gives no gradient
    unweighted, _ = policy_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(unweighted, torch.tensor(0.5))
