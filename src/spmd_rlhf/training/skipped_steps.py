"""Optimizer steps skipped for a non-finite gradient norm: counted, and bounded.

A NaN or infinite loss or gradient (overflowing rewards, a diverging model) leaves the weights as they were, but a
run that skips every step learns nothing while it reports progress. ``SkippedSteps`` counts the skips for the
metrics and stops the run when more than ``trainer.max_skipped_steps`` come in a row.
"""

from __future__ import annotations

import math


class NonFiniteStepsError(RuntimeError):
    """More consecutive optimizer steps had a non-finite gradient norm than ``trainer.max_skipped_steps`` allows."""


class SkippedSteps:
    def __init__(self, max_consecutive: int, *, role: str) -> None:
        self.max_consecutive = max_consecutive
        self.role = role
        self.consecutive = 0
        self.total = 0

    def allows(self, gradient_norm: float, *, step: int, stage: str) -> bool:
        """Whether the optimizer step with this (global, all-reduced) gradient norm is applied; a skip is counted,
        and one past the limit raises, naming the training step and the stage (the same on every rank of the role,
        since the norm is)."""
        if math.isfinite(gradient_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total += 1
        if self.consecutive > self.max_consecutive:
            raise NonFiniteStepsError(
                f"{self.role}: non-finite gradient norm ({gradient_norm}) at training step {step} in {stage}, "
                f"{self.consecutive} consecutive optimizer step(s) skipped, more than "
                f"trainer.max_skipped_steps={self.max_consecutive}; the loss or the advantages are not finite (check "
                f"the rewards' range and the learning rate), or raise trainer.max_skipped_steps"
            )
        return False
