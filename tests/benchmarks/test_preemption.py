"""``benchmarks/preemption.py``: the scheduler simulation finishes every request on a pool smaller than the work,
re-prefilling only after preemptions, and a growth reserve admits less eagerly (fewer preemptions)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from preemption import simulate  # noqa: E402


def test_long_sequences_finish_on_a_small_pool_and_a_reserve_preempts_less():
    plain, reserved = simulate(140, 0.0, seed=0), simulate(140, 0.3, seed=0)
    assert plain["preemptions"] > reserved["preemptions"] > 0
    assert plain["recomputed_tokens"] > reserved["recomputed_tokens"] > 0
    roomy = simulate(2000, 0.0, seed=0)
    assert roomy["preemptions"] == roomy["recomputed_tokens"] == 0
    assert roomy["steps"] == 2048  # one prefill (its first token) then 2,047 decode steps of the longest
