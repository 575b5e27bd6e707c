import math

import pytest
import torch

from spmd_rlhf.algos import (
    AdaptiveKLController,
    Denominators,
    FixedKLController,
    aggregate,
    apply_kl_penalty,
    cispo_loss,
    entropy_bonus,
    gmpo_loss,
    kl_estimate,
    policy_loss,
    sapo_loss,
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


def test_cispo_keeps_the_gradient_of_tokens_beyond_the_clip():
    ratios = torch.tensor([[1.5, 0.5, 1.1]])
    old = torch.log(torch.tensor([[0.2, 0.4, 0.5]]))
    log_probs = (old + ratios.log()).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    loss, metrics = cispo_loss(log_probs, old, advantages, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    # weights clip(ratio) = 1.2, 0.8, 1.1 (constants): l_t = -w_t * A_t * log pi_t, token mean
    expected = -(1.2 * 1.0 * log_probs[0, 0] - 0.8 * log_probs[0, 1] + 1.1 * 2.0 * log_probs[0, 2]) / 3
    torch.testing.assert_close(loss, expected)
    loss.backward()
    # PPO would give the first two tokens no gradient (clipped); CISPO gives each -w_t * A_t / 3.
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.2, 0.8, -2.2]]) / 3)
    assert metrics["actor/clip_fraction"] == pytest.approx(2 / 3)


def test_gmpo_is_the_geometric_mean_ratio_clipped_in_log_space_per_response():
    log_ratio = torch.tensor([[0.6, -0.2, 0.0], [0.1, -0.6, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    old = torch.full((2, 3), -1.0)
    log_probs = (old + log_ratio).requires_grad_()
    loss, _ = gmpo_loss(log_probs, old, advantages, mask, clip_low=0.4, clip_high=0.4)
    # Row 0 (A > 0): min(0.6, 0.4) = 0.4 and min(-0.2, -0.2): mean 0.1. Row 1 (A < 0): the pessimistic side is the
    # max: max(0.1, 0.1), max(-0.6, -0.4) = -0.4, max(0.3, 0.3): mean 0. Loss: mean over the responses of -A * s.
    expected = (-1.0 * math.exp(0.1) + 2.0 * math.exp(0.0)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # Clipped tokens carry no gradient; the others get -A * s / (2 * length).
    expected_grad = [[0.0, -math.exp(0.1) / 4, 0.0], [2.0 / 6, 0.0, 2.0 / 6]]
    torch.testing.assert_close(log_probs.grad, torch.tensor(expected_grad))


def test_sapo_gradient_at_ratio_one_is_minus_advantage_and_fades_away_from_it():
    advantages = torch.tensor([[2.0, -1.0]])
    log_probs = torch.zeros(1, 2, requires_grad=True)
    loss, _ = sapo_loss(log_probs, torch.zeros(1, 2), advantages, torch.ones(1, 2), tau_positive=1.0, tau_negative=1.05)
    # f(1) = sigmoid(0) * 4 / tau = 2 / tau: the loss is -(2 * 2 / 1 - 1 * 2 / 1.05) / 2.
    assert loss.item() == pytest.approx(-(4.0 - 2.0 / 1.05) / 2)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, -advantages / 2)
    far = torch.full((1, 2), math.log(10.0), requires_grad=True)
    sapo_loss(far, torch.zeros(1, 2), advantages, torch.ones(1, 2), tau_positive=1.0, tau_negative=1.05)[0].backward()
    # d/dlog pi of -sigmoid(tau (r - 1)) * 4 / tau * A at r = 10: -4 A r sigmoid'(9 tau).
    gate = [torch.sigmoid(torch.tensor(9.0 * tau)) for tau in (1.0, 1.05)]
    slope = [4 * 10 * value * (1 - value) for value in gate]
    torch.testing.assert_close(far.grad, torch.tensor([[-2.0 * slope[0], 1.0 * slope[1]]]) / 2)
    assert far.grad.abs().max() < 0.01 * log_probs.grad.abs().max()


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    """verl 0.9's ``cispo`` policy loss, term for term, with token-mean aggregation."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    losses = -clipped_ratio * advantages * log_prob
    return (losses * response_mask).sum() / response_mask.sum()


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    """verl 0.9's ``geo_mean`` (GMPO) policy loss, term for term."""
    negative_approx_kl = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -clip_low, clip_high)
    pessimistic = sgn * torch.min(sgn * negative_approx_kl, sgn * clamped)
    lengths = response_mask.sum(dim=-1)
    ratio = torch.exp((pessimistic * response_mask).sum(dim=-1) / (lengths + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    return torch.mean(-advantage * ratio)


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos, tau_neg):
    """verl 0.9's ``sapo`` policy loss, term for term, with token-mean aggregation."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    taus = torch.where(advantages > 0, torch.tensor(tau_pos), torch.tensor(tau_neg))
    losses = -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * advantages
    return (losses * response_mask).sum() / response_mask.sum()


@pytest.mark.parametrize("name", ["cispo", "gmpo", "sapo"])
def test_the_2026_losses_equal_verls_in_value_and_gradient(name):
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=generator) * 3
    log_probs = (old + torch.randn(6, 9, generator=generator) * 0.3).requires_grad_()
    advantages = torch.randn(6, 1, generator=generator).expand(6, 9).contiguous()
    mask = (torch.arange(9)[None] < torch.randint(1, 10, (6, 1), generator=generator)).float()
    ours, theirs = {
        "cispo": (
            lambda: cispo_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.28)[0],
            lambda: verl_cispo(old, log_probs, advantages, mask, 0.2, 0.28),
        ),
        "gmpo": (
            lambda: gmpo_loss(log_probs, old, advantages, mask, clip_low=0.4, clip_high=0.4)[0],
            lambda: verl_geo_mean(old, log_probs, advantages, mask, 0.4, 0.4),
        ),
        "sapo": (
            lambda: sapo_loss(log_probs, old, advantages, mask, tau_positive=1.0, tau_negative=1.05)[0],
            lambda: verl_sapo(old, log_probs, advantages, mask, 1.0, 1.05),
        ),
    }[name]
    ours_value = ours()
    (ours_grad,) = torch.autograd.grad(ours_value, log_probs)
    theirs_value = theirs()
    (theirs_grad,) = torch.autograd.grad(theirs_value, log_probs)
    torch.testing.assert_close(ours_value, theirs_value, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-6, atol=1e-6)
