"""Safe-RLHF (Dai et al. 2023): PPO under a cost constraint via a Lagrange multiplier.

The policy maximises the reward subject to E[cost] ≤ d. The Lagrangian relaxation min_λ≥0 max_π J_r(π) − λ·(J_c(π) − d)
is solved by alternating a PPO step on the combined advantage

    A = (A_reward − λ·A_cost) / (1 + λ)

(dividing by 1 + λ keeps its scale whatever λ is) with an ascent step on λ, which rises while the mean episode
cost exceeds d and falls once it is below. λ is log-parameterised, so it stays positive, and each step scales it by
at most e^(lr·|J_c − d|) (a step on log λ along the sign and size of the violation, rather than the raw gradient
λ·(J_c − d), which would compound once λ is large):

    log λ ← log λ + lr · (J_c − d)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def combine_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, multiplier: float
) -> torch.Tensor:
    """(A_reward − λ·A_cost) / (1 + λ)."""
    if multiplier < 0:
        raise ValueError(f"the Lagrange multiplier must be >= 0, got {multiplier}")
    return (reward_advantages - multiplier * cost_advantages) / (1.0 + multiplier)


@dataclass
class LagrangeMultiplier:
    """λ ≥ 0 of the cost constraint, log-parameterised; ``update`` takes one ascent step from a batch's mean cost."""

    value: float
    lr: float
    threshold: float
    max_value: float | None = None

    def __post_init__(self) -> None:
        if self.value <= 0:
            raise ValueError(f"the initial Lagrange multiplier must be > 0 (log-parameterised), got {self.value}")

    def update(self, mean_cost: float) -> float:
        """One step from the batch's mean episode cost; returns the new λ."""
        if not math.isfinite(mean_cost):
            raise ValueError(f"mean episode cost {mean_cost} is not finite")
        log_value = math.log(self.value) + self.lr * (mean_cost - self.threshold)
        self.value = math.exp(log_value)
        if self.max_value is not None:
            self.value = min(self.value, self.max_value)
        return self.value
