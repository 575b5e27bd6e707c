"""Rollout correction: importance weights and rejection for samples whose behaviour policy is not the trained one.

A response is sampled from the behaviour policy μ (the engine's log-probs: an older policy under asynchrony, and at
any staleness a different numerical path: kernels, precision, tensor-parallel sums) and trains π_θ. PPO takes its
ratio against the proximal policy π_old (log-probs recomputed under the weights the step starts from; decoupled PPO,
Hilton et al. 2022), and the gap between π_old and μ is corrected here, with δ_t = log π_old(y_t) − log μ(y_t) over
the response tokens:

    level      ratio of a token                   (broadcast to every token of its response but for "token")
    token      ρ_t = exp(δ_t)
    sequence   ρ   = exp(Σ_t δ_t)                 (the product of the token ratios)
    geometric  ρ   = exp(mean_t δ_t)              (their geometric mean: length-independent; tight bounds, ~1.001)

Each exponent is clamped to [−20, 20] first. Two mechanisms, each with its own level (as verl's rollout correction
separates them):

- **importance weights** (``is_level``): each token's loss is multiplied by ``min(ρ, is_threshold)`` (truncated IS,
  Espeholt et al. 2018); constants of the loss, no gradient flows through them.
- **rejection** (``rs_level``): a token (``token``) or a whole response (``sequence``, ``geometric``) whose ratio is
  outside ``[rs_lower, rs_upper]`` leaves the loss and its denominator (masked IS: ICEPOP, Ling Team 2025, and
  prime-rl at the token level); ``veto_threshold``: a response holding any token with ρ_t below it is rejected whole.

``config.algorithm.CORRECTION_PRESETS`` name the combinations verl documents (``algorithm.correction.preset``).
With π_old = μ (log-probs not recomputed) every ratio is 1 and nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    """One rollout correction; ``None`` levels switch a mechanism off."""

    is_level: str | None = "token"
    is_threshold: float = 2.0
    rs_level: str | None = None
    rs_upper: float = 2.0
    rs_lower: float = 0.5
    veto_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("is_level", "rs_level"):
            level = getattr(self, name)
            if level is not None and level not in LEVELS:
                raise ValueError(f"{name}={level!r} is unknown; choose one of {', '.join(LEVELS)} or None")
        if self.is_threshold <= 1:
            raise ValueError(f"is_threshold={self.is_threshold} must be > 1")
        if not 0 <= self.rs_lower < 1 < self.rs_upper:
            raise ValueError(f"rejection bounds [{self.rs_lower}, {self.rs_upper}] must hold 1 inside them")
        if self.veto_threshold is not None and not 0 < self.veto_threshold < 1:
            raise ValueError(f"veto_threshold={self.veto_threshold} must be in (0, 1)")

    @property
    def active(self) -> bool:
        return self.is_level is not None or self.rs_level is not None or self.veto_threshold is not None


@dataclass
class Corrected:
    """What ``correct`` returns: ``weights`` ``[rows, R]`` (1 without IS, 0 past the response) and ``loss_mask``
    (the response mask less the rejected tokens), both detached; ``metrics``: 0-dim tensors, see ``correct``."""

    weights: torch.Tensor
    loss_mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log ρ`` ``[rows, R]`` at ``level`` (unclamped) from per-token ``log_ratio`` (0 past the response)."""
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum(dim=1, keepdim=True)
    if level == "sequence":
        return total.expand_as(log_ratio)
    return (total / mask.sum(dim=1, keepdim=True).clamp(min=1.0)).expand_as(log_ratio)


def correct(
    proximal_log_probs: torch.Tensor, behaviour_log_probs: torch.Tensor, mask: torch.Tensor, correction: Correction
) -> Corrected:
    """Weights and rejection of ``correction`` for the responses ``mask`` ``[rows, R]`` selects, and its metrics
    (sums and extremes, so that a caller can combine them over ranks): ``tokens`` and ``sequences`` counted,
    ``log_ratio_sum`` (Σ δ_t: the mean gap is ``log_ratio_sum / tokens``), ``k3_sum`` (Σ ρ_t − 1 − δ_t, an estimate
    of KL(π_old ‖ μ) per token), ``weight_min`` / ``weight_max`` / ``weight_sum`` (the ratio at the IS level, or
    the token level without IS, before truncation), ``truncated_tokens``, ``rejected_tokens``,
    ``rejected_sequences`` (responses with no token left) and ``vetoed_sequences``."""
    with torch.no_grad():
        mask_f = mask.to(torch.float32)
        selected = mask_f.bool()
        log_ratio = (proximal_log_probs.float() - behaviour_log_probs.float()) * mask_f
        token_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        keep = selected.clone()
        weights = mask_f.clone()
        level = correction.is_level or "token"
        ratio = level_log_ratio(log_ratio, mask_f, level).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        truncated = selected & (ratio > correction.is_threshold)
        if correction.is_level is not None:
            weights = ratio.clamp(max=correction.is_threshold) * mask_f
        if correction.rs_level is not None:
            bounded = level_log_ratio(log_ratio, mask_f, correction.rs_level).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            inside = (bounded <= math.log(correction.rs_upper)) & (
                bounded >= (math.log(correction.rs_lower) if correction.rs_lower > 0 else -math.inf)
            )
            keep &= inside
        vetoed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
        if correction.veto_threshold is not None:
            vetoed = (selected & (log_ratio < math.log(correction.veto_threshold))).any(dim=1)
            keep &= ~vetoed[:, None]
        responses = selected.any(dim=1)
        largest = torch.finfo(torch.float32).max
        metrics = {
            "tokens": mask_f.sum(),
            "sequences": responses.float().sum(),
            "log_ratio_sum": log_ratio.sum(),
            "k3_sum": ((token_ratio - 1 - log_ratio) * mask_f).sum(),
            "weight_min": torch.where(selected, ratio, largest).amin() if mask.numel() else mask_f.sum(),
            "weight_max": torch.where(selected, ratio, 0.0).amax() if mask.numel() else mask_f.sum(),
            "weight_sum": (ratio * mask_f).sum(),
            "truncated_tokens": (truncated & keep).float().sum() if correction.is_level else mask_f.sum() * 0,
            "rejected_tokens": (selected & ~keep).float().sum(),
            "rejected_sequences": (responses & ~keep.any(dim=1)).float().sum(),
            "vetoed_sequences": (vetoed & responses).float().sum(),
        }
    return Corrected(weights * keep, keep, metrics)


SUMMED = ("tokens", "sequences", "log_ratio_sum", "k3_sum", "weight_sum", "truncated_tokens", "rejected_tokens")
SUMMED += ("rejected_sequences", "vetoed_sequences")


def correction_metrics(sums: dict[str, float], weight_min: float, weight_max: float) -> dict[str, float]:
    """The logged ``off_policy/*`` metrics from ``correct``'s sums (over ranks) and extremes."""
    tokens, sequences = max(sums["tokens"], 1.0), max(sums["sequences"], 1.0)
    return {
        "off_policy/importance_weight_min": weight_min,
        "off_policy/importance_weight_max": weight_max,
        "off_policy/importance_weight_mean": sums["weight_sum"] / tokens,
        "off_policy/log_prob_gap_mean": sums["log_ratio_sum"] / tokens,
        "off_policy/kl_k3": sums["k3_sum"] / tokens,
        "off_policy/truncated_token_fraction": sums["truncated_tokens"] / tokens,
        "off_policy/rejected_token_fraction": sums["rejected_tokens"] / tokens,
        "off_policy/rejected_sequence_fraction": sums["rejected_sequences"] / sequences,
        "off_policy/vetoed_sequence_fraction": sums["vetoed_sequences"] / sequences,
    }
