import math

import pytest
import torch

from spmd_rlhf.algos import (
    AdaptiveKLController,
    Denominators,
    FixedKLController,
    aggregate,
    apply_kl_penalty,
    entropy_bonus,
    kl_estimate,
    policy_loss,
    value_loss,
)

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 10 / 4),
        ("seq_mean_token_sum", 10 / 2),
        ("seq_mean_token_mean", (2 + 4) / 2),
        ("seq_mean_token_sum_norm", 10 / 6),
    ],
)
def test_aggregation_modes(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_split_batches_sum_to_the_whole_with_global_denominators(mode):
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 5, generator=generator)
    mask = (torch.rand(8, 5, generator=generator) > 0.3).long()
    whole = aggregate(loss, mask, mode)
    counts = Denominators.local(mask)
    parts = sum(aggregate(loss[i : i + 3], mask[i : i + 3], mode, counts) for i in range(0, 8, 3))
    torch.testing.assert_close(parts, whole)


def test_unknown_aggregation_is_named():
    with pytest.raises(ValueError, match="'mean' is not one of token_mean"):
        aggregate(LOSS, MASK, "mean")


def test_kl_estimators_match_hand_computation():
    log_probs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_estimate(log_probs, ref, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(log_probs, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(log_probs, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    # k3 stays finite and bounded for a wildly unlikely token.
    assert kl_estimate(torch.tensor([-100.0]), torch.tensor([0.0]), "k3").item() == pytest.approx(10.0)
    penalised = apply_kl_penalty(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), 0.1, torch.tensor([[1, 1]]))
    torch.testing.assert_close(penalised, torch.tensor([[-0.05, 0.95]]))
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(log_probs, ref, "k4")


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(50.0, 100)
    assert fixed.coef == 0.1
    adaptive = AdaptiveKLController(coef=0.1, target=6.0, horizon=10_000)
    adaptive.update(9.0, 100)  # error clipped to 0.2
    assert adaptive.coef == pytest.approx(0.1 * (1 + 0.2 * 100 / 10_000))
    adaptive.update(5.4, 100)  # error -0.1
    assert adaptive.coef == pytest.approx(0.1 * 1.002 * (1 - 0.1 * 100 / 10_000))


def test_policy_loss_clip_higher_and_dual_clip():
    ratios = torch.tensor([[1.5, 1.5, 4.0, 0.5]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    loss, metrics = policy_loss(ratios.log(), old, advantages, mask, clip_low=0.2, clip_high=0.2)
    # per token: max(-1.5, -1.2) = -1.2; max(1.5, 1.2) = 1.5; max(4, 1.2) = 4; max(-0.5, -0.8) = -0.5
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 4.0 - 0.5) / 4)
    assert metrics["actor/clip_fraction"] == pytest.approx(0.25)
    loss, metrics = policy_loss(ratios.log(), old, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 3.0 - 0.5) / 4)  # the A<0 token at ratio 4 is capped at 3
    assert metrics["actor/dual_clip_fraction"] == pytest.approx(0.25)
    loss, _ = policy_loss(ratios.log(), old, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx((-1.28 + 1.5 + 4.0 - 0.5) / 4)
    with pytest.raises(ValueError, match="dual_clip=0.5"):
        policy_loss(ratios.log(), old, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=0.5)


def test_policy_gradient_at_ratio_one_is_minus_advantage():
    log_probs = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(
        log_probs, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2
    )
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 0.5]]))


def test_clipped_value_loss():
    values = torch.tensor([[2.0, 0.8, 1.8]])
    old = torch.ones(1, 3)
    returns = torch.tensor([[0.0, 2.0, 2.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 3), clip=0.5)
    # 0.5 * [max(4, 2.25), max(1.44, 1.44), max(0.04, 0.25)]
    assert loss.item() == pytest.approx(0.5 * (4.0 + 1.44 + 0.25) / 3)
    assert metrics["critic/clip_fraction"] == pytest.approx(1 / 3)
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 3), clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (4.0 + 1.44 + 0.04) / 3)


def test_entropy_bonus_aggregates():
    assert entropy_bonus(LOSS, MASK).item() == pytest.approx(2.5)


def test_config_offers_exactly_the_aggregation_modes():
    from spmd_rlhf.algos import AGGREGATIONS
    from spmd_rlhf.config import LOSS_AGGREGATIONS

    assert LOSS_AGGREGATIONS == AGGREGATIONS
