"""Tests for the learning-rate schedule of trained roles: linear warm-up, then constant or cosine."""

from __future__ import annotations

import math

import pytest

from spmd_rlhf.training.trainer import learning_rate_factor


def test_warmup_then_constant():
    factors = [
        learning_rate_factor(step, warmup_steps=4, schedule="constant", total_steps=10, min_lr_ratio=0.0)
        for step in range(6)
    ]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_to_min_ratio_at_total_steps():
    factor = lambda step: learning_rate_factor(
        step, warmup_steps=2, schedule="cosine", total_steps=12, min_lr_ratio=0.1
    )  # noqa: E731
    assert factor(2) == pytest.approx(1.0)
    assert factor(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(12) == pytest.approx(0.1) and factor(20) == pytest.approx(0.1)
