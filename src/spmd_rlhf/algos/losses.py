"""Policy, value and entropy losses: per-token terms aggregated by ``aggregation.aggregate``.

PPO clipped surrogate (Schulman et al. 2017) with separate low/high clip ratios (DAPO's clip-higher) and dual clip
(Ye et al. 2020), for ratio ρ = exp(log π − log π_old) and advantage A:

    l = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high));   for A < 0 also  l = min(l, −A·c)   (c > 1, dual clip)

GSPO (Zheng et al. 2025, ``ratio_level="sequence"``): one importance ratio per response, the geometric mean of its
token ratios, s_i = exp(mean_t(log π − log π_old)), clipped as above; each token carries s_i with the gradient of its
own log-probability (s_i,t = sg[s_i] · π_t / sg[π_t]), so the ratio is that of the sequence and the gradient flows
through every token.

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
