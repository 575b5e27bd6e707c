"""Ulysses context parallelism (``models.context_parallel``): a packed row split over 4 gloo ranks equals one
process's attention, outputs and gradients (``programs/ulysses_attention.py``; cp = 2 runs in every role's parity
test, tests/training/test_context_parallel_roles.py); the refusals and the traffic count."""

from __future__ import annotations

import pytest
from torchrun_helpers import torchrun

from spmd_rlhf.models.context_parallel import check_ulysses, replicated_kv_heads, ulysses_bytes


@pytest.mark.parametrize("cp", [4])
def test_ulysses_attention_equals_one_process_on_packed_rows(cp):
    finished = torchrun("ulysses_attention.py", nproc=cp, timeout=180)
    assert finished.returncode == 0, finished.stdout[-6000:]


@pytest.mark.parametrize(
    "heads, kv_heads, cp, tokens, message",
    [
        (14, 2, 4, 64, "actor.cp=4 does not divide the model's 14 attention heads"),
        (8, 2, 4, 66, "a packed row of 66 tokens does not split into actor.cp=4 equal chunks; pad it"),
        (16, 3, 4, 64, "the 3 key/value heads, replicated to 12 so that 4 ranks can split them, no longer divide"),
    ],
)
def test_ulysses_refusals_name_the_key(heads, kv_heads, cp, tokens, message):
    with pytest.raises(ValueError, match=message):
        check_ulysses(heads=heads, kv_heads=kv_heads, cp=cp, tokens=tokens, key="actor.cp")
    check_ulysses(heads=12, kv_heads=3, cp=4, tokens=64, key="actor.cp")  # 3 heads replicated to 12: accepted


def test_replicated_heads_and_bytes():
    assert [replicated_kv_heads(kv, 4) for kv in (1, 2, 4, 8)] == [4, 4, 4, 8]
    # 4096 tokens over 4 ranks, 32 query and 8 key/value heads of 128 dims in bf16: q, k, v and the output.
    assert ulysses_bytes(tokens=4096, heads=32, kv_heads=8, head_dim=128, cp=4, dtype_bytes=2) == (
        1024 * (64 + 16) * 128 * 2 * 3 / 4
    )
