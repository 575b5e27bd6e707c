"""Policy, value and entropy losses: per-token terms aggregated by ``aggregation.aggregate``.

PPO clipped surrogate (Schulman et al. 2017) with separate low/high clip ratios (DAPO's clip-higher) and dual clip
(Ye et al. 2020), for ratio ρ = exp(log π − log π_old) and advantage A:

    l = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high));   for A < 0 also  l = min(l, −A·c)   (c > 1, dual clip)

GSPO (Zheng et al. 2025, ``ratio_level="sequence"``): one importance ratio per response, the geometric mean of its
token ratios, s_i = exp(mean_t(log π − log π_old)), clipped as above; each token carries s_i with the gradient of its
own log-probability (s_i,t = sg[s_i] · π_t / sg[π_t]), so the ratio is that of the sequence and the gradient flows
through every token.

CISPO, GMPO and SAPO (``cispo_loss``, ``gmpo_loss``, ``sapo_loss``) follow verl's ``cispo``, ``geo_mean`` and ``sapo``
policy losses term for term (tests compare them within 1e-6).

Clipped value loss: l = ½·max((V − R)², (V_old + clip(V − V_old, −ε_v, ε_v) − R)²).

Metrics come back as 0-dim tensors on the loss's device: a trainer reads them once per update, not once per
micro-batch (each read waits for the device).
"""

from __future__ import annotations

import torch

from spmd_rlhf.algos.aggregation import Denominators, aggregate, masked_mean

RATIO_LEVELS = ("token", "sequence")


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    denominators: Denominators | None = None,
    ratio_level: str = "token",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The aggregated PPO policy loss and its metrics (clip fractions, approximate KL to π_old).
    ``ratio_level``: ``token`` (PPO) or ``sequence`` (GSPO). ``token_weights``: constants multiplying each token's
    loss before aggregation (the off-policy importance weights, ``off_policy.importance_weights``); None: 1."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None)")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level={ratio_level!r} is unknown; choose one of {', '.join(RATIO_LEVELS)}")
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    if ratio_level == "sequence":
        mask_f = mask.to(log_ratio.dtype)
        sequence_log_ratio = (log_ratio * mask_f).sum(dim=1) / mask_f.sum(dim=1).clamp(min=1.0)
        log_ratio = sequence_log_ratio.detach()[:, None] + log_probs - log_probs.detach()
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_clipped, bound, loss)
    if token_weights is not None:
        loss = loss * token_weights
    with torch.no_grad():
        metrics = {
            "actor/clip_fraction": masked_mean((clipped > unclipped).float(), mask),
            "actor/dual_clip_fraction": masked_mean(dual_clipped.float(), mask),
            "actor/approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
        }
    return aggregate(loss, mask, aggregation, denominators), metrics


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    aggregation: str = "token_mean",
    denominators: Denominators | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): l = −sg[clip(ρ, 1 − ε_low, 1 + ε_high)]·A·log π. The clipped ratio is
    a constant weight of the REINFORCE term, so a token beyond the clip range keeps its gradient (PPO's clip zeroes
    it). verl's ``cispo``."""
    ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0).exp()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    loss = -clipped * advantages * log_probs
    if token_weights is not None:
        loss = loss * token_weights
    with torch.no_grad():
        metrics = {
            "actor/clip_fraction": masked_mean((clipped != ratio).float(), mask),
            "actor/approx_kl": masked_mean(0.5 * (log_probs - old_log_probs).square(), mask),
        }
    return aggregate(loss, mask, aggregation, denominators), metrics


def gmpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    denominators: Denominators | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al. 2025): one ratio per response, the geometric mean of its token ratios with each token's
    log-ratio clipped to [−ε_low, ε_high] in log space on the side the advantage's sign makes pessimistic:

        s_i = exp(mean_t min(sgn(A)·δ_t, sgn(A)·clip(δ_t, −ε_low, ε_high)) · sgn(A)),   l_i = −mean_t(A_t) · s_i

    averaged over the responses (the paper's clip range (e^−0.4, e^0.4) is clip_ratio_low = clip_ratio_high = 0.4).
    ``token_weights`` enter as the geometric mean of each response's weights (a sequence-level correction). verl's
    ``geo_mean``."""
    mask_f = mask.to(log_probs.dtype)
    lengths = mask_f.sum(dim=1)
    log_ratio = log_probs - old_log_probs
    sign = torch.sign(advantages)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    ratio = torch.exp((pessimistic * mask_f).sum(dim=1) / (lengths + 1e-8))
    advantage = (advantages * mask_f).sum(dim=1) / (lengths + 1e-8)
    loss = -advantage * ratio
    if token_weights is not None:
        loss = loss * torch.exp((torch.log(token_weights + 1e-10) * mask_f).sum(dim=1) / (lengths + 1e-8)).detach()
    sequences = denominators.sequences if denominators is not None else float(mask.shape[0])
    with torch.no_grad():
        metrics = {
            "actor/clip_fraction": masked_mean((clipped != log_ratio).float(), mask),
            "actor/approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
        }
    return loss.sum() / max(sequences, 1.0), metrics


def sapo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_positive: float,
    tau_negative: float,
    aggregation: str = "token_mean",
    denominators: Denominators | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al. 2025): a smooth gate in place of the hard clip, f(ρ) = σ(τ·(ρ − 1))·4/τ, l = −f(ρ)·A, with
    τ = τ_pos for A > 0 and τ_neg otherwise; at ρ = 1 its gradient equals the policy gradient, and it fades as ρ
    leaves 1 (faster for the larger τ). verl's ``sapo``."""
    if tau_positive <= 0 or tau_negative <= 0:
        raise ValueError(f"SAPO temperatures must be > 0 (tau_positive={tau_positive}, tau_negative={tau_negative})")
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    tau = torch.where(advantages > 0, tau_positive, tau_negative).to(ratio.dtype)
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    if token_weights is not None:
        loss = loss * token_weights
    with torch.no_grad():
        metrics = {"actor/approx_kl": masked_mean(0.5 * log_ratio.square(), mask)}
    return aggregate(loss, mask, aggregation, denominators), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None,
    aggregation: str = "token_mean",
    denominators: Denominators | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The aggregated (clipped) value loss and the fraction of tokens where the clipped term was larger."""
    unclipped = (values - returns).square()
    if clip is None:
        loss, clipped_more = unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns).square()
        loss, clipped_more = torch.maximum(unclipped, clipped), clipped > unclipped
    metrics = {"critic/clip_fraction": masked_mean(clipped_more.float(), mask).detach()}
    return aggregate(0.5 * loss, mask, aggregation, denominators), metrics


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token_mean",
    denominators: Denominators | None = None,
) -> torch.Tensor:
    """Aggregated entropy; the policy objective subtracts ``entropy_coef`` times it from the loss."""
    return aggregate(entropy, mask, aggregation, denominators)
