"""Context parallelism's attention (``models.context_parallel``, ``models.ring_attention``): a packed row split over 4
gloo ranks equals one process's attention, outputs and gradients, by Ulysses (``programs/ulysses_attention.py``) and
by ring attention over zig-zag chunks at cp = 2 and 4 (``programs/ring_attention.py``); every role runs both in
tests/training/test_context_parallel_roles.py. The choice between them, the refusals, the zig-zag layout and the
traffic counts."""

from __future__ import annotations

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.models.context_parallel import (
    check_ulysses,
    replicated_kv_heads,
    resolve_cp_attention,
    ulysses_bytes,
)
from spmd_rlhf.models.ring_attention import check_ring, ring_bytes, zigzag_positions, zigzag_ranges
from spmd_rlhf.training.context_parallel import ContextRow


@pytest.mark.parametrize("cp", [4])
def test_ulysses_attention_equals_one_process_on_packed_rows(cp):
    finished = torchrun("ulysses_attention.py", nproc=cp, timeout=180, forked=True)
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


def test_ring_attention_over_zigzag_chunks_equals_one_process():
    finished = torchrun("ring_attention.py", nproc=4, timeout=180, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]


def test_auto_takes_ulysses_where_it_splits_the_heads_and_ring_elsewhere():
    assert resolve_cp_attention("auto", heads=14, kv_heads=2, cp=2) == "ulysses"
    assert resolve_cp_attention("auto", heads=14, kv_heads=2, cp=4) == "ring"  # 4 does not divide 14
    assert resolve_cp_attention("auto", heads=2, kv_heads=1, cp=8) == "ring"  # more ranks than heads
    assert resolve_cp_attention("ring", heads=16, kv_heads=8, cp=2) == "ring"
    with pytest.raises(ValueError, match=r"actor\.cp=4 does not divide .* \(or set actor\.cp_attention=ring\)"):
        resolve_cp_attention("ulysses", heads=14, kv_heads=2, cp=4, role="actor")
    with pytest.raises(ValueError, match="actor.cp_attention='striped' is unknown"):
        resolve_cp_attention("striped", heads=14, kv_heads=2, cp=2, role="actor")
    with pytest.raises(ValueError, match=r"2 x actor\.cp=4 zig-zag chunks; pad it"):
        check_ring(cp=4, tokens=36, key="actor.cp")


def test_the_config_key_and_its_choices():
    from spmd_rlhf.config import CP_ATTENTION, ConfigError, load_config
    from spmd_rlhf.models.context_parallel import CP_ATTENTION as MODEL_CHOICES

    assert CP_ATTENTION == MODEL_CHOICES
    assert load_config(None, []).critic.cp_attention == "auto"
    with pytest.raises(ConfigError, match="cp_attention"):
        load_config(None, ["actor.cp_attention=striped"])


def test_zigzag_chunks_balance_causal_work_and_gather_back_into_row_order():
    assert zigzag_ranges(0, 4, 32) == ((0, 4), (28, 32)) and zigzag_ranges(3, 4, 32) == ((12, 16), (16, 20))
    everyone = torch.cat([zigzag_positions(rank, 4, 32) for rank in range(4)])
    assert sorted(everyone.tolist()) == list(range(32))
    work = [sum(row + 1 for row in zigzag_positions(rank, 4, 32).tolist()) for rank in range(4)]
    assert len(set(work)) == 1  # contiguous chunks would give rank r about 2r + 1 times rank 0's
    # A packed row of 16 tokens (sequences of 7 and 9), the head reading 9 positions scattered over it.
    reads = torch.tensor([1, 2, 3, 5, 8, 9, 12, 14, 15])
    row = ContextRow(torch.arange(16), torch.arange(16), torch.tensor([0, 7, 16]), 9, reads, 0, zigzag=True)
    # Relative to each rank's chunk, the positions it holds of those the head reads.
    held = [row.positions(rank, 4)[row.gather_inputs(rank, 4, labels=False)[0]["held"]] for rank in range(4)]
    assert torch.equal(row.chunk(1, 4)[0], torch.tensor([2, 3, 12, 13]))  # chunks 1 and 6 of 8
    assert [len(positions) for positions in held] == [3, 3, 1, 2]
    inputs, most = row.gather_inputs(1, 4, labels=True)
    assert most == 3 and inputs["keep"].tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 10]  # each rank's padded to 3
    assert torch.equal(inputs["labels"], held[1] + 1)  # the row's next tokens (here token id = position)
    gathered = torch.cat(held)  # what gather_rows lays out: rank by rank, each in its chunk's order
    assert not torch.equal(gathered, reads) and torch.equal(gathered[inputs["order"]], reads)
    contiguous = ContextRow(torch.arange(16), torch.arange(16), torch.tensor([0, 7, 16]), 9, reads, 0)
    inputs, most = contiguous.gather_inputs(0, 4, labels=False)
    assert "order" not in inputs and "labels" not in inputs and inputs["keep"].tolist() == [0, 1, 2, 3, 6, 7, 9, 10, 11]


def test_ring_bytes():
    # 4096 tokens over 4 ranks, 8 key/value heads of 128 dims in bf16: a chunk's keys and values, 3 times.
    assert ring_bytes(tokens=4096, kv_heads=8, head_dim=128, cp=4, dtype_bytes=2) == 1024 * 2 * 8 * 128 * 2 * 3
