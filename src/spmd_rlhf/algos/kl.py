"""KL(π ‖ π_ref) per token, from log-probs of the sampled tokens, and the controllers of its coefficient.

With log r = log π_ref(a) − log π(a) for a ~ π (Schulman, "Approximating KL divergence", 2020):
- k1 = −log r                 (unbiased, high variance, can be negative)
- k2 = (log r)² / 2           (biased, low variance)
- k3 = r − 1 − log r          (unbiased, low variance, ≥ 0); log r is clamped to [−``clamp``, ``clamp``] before
  exponentiating, and the result to [0, ``clamp``], so one outlier token cannot blow up the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k1", *, clamp: float = 10.0
) -> torch.Tensor:
    log_ratio = ref_log_probs - log_probs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-clamp, clamp)
        return (log_ratio.exp() - 1 - log_ratio).clamp(0.0, clamp)
    raise ValueError(f"KL estimator {estimator!r} is not one of {', '.join(ESTIMATORS)}")


def apply_kl_penalty(token_rewards: torch.Tensor, kl: torch.Tensor, coef: float, mask: torch.Tensor) -> torch.Tensor:
    """r'_t = r_t − β·KL_t on response tokens."""
    return token_rewards - coef * kl * mask.to(kl.dtype)


@dataclass
class FixedKLController:
    coef: float

    def update(self, current_kl: float, steps: int) -> None:
        """A fixed coefficient ignores the observed KL."""


@dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019): β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · steps / horizon)."""

    coef: float
    target: float
    horizon: int

    def update(self, current_kl: float, steps: int) -> None:
        if not math.isfinite(current_kl):
            raise ValueError(f"observed KL {current_kl} is not finite")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * steps / self.horizon
