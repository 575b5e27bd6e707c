"""Paged-KV attention equals plain causal attention over each sequence's whole context, prefix shared in-step."""

from __future__ import annotations

import pytest
import torch

from spmd_rlhf.models.attention import AttentionBatch, attend
from spmd_rlhf.models.paged_kv import PagedKV

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
SCALE = HEAD_DIM**-0.5


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last ``len(q)`` queries of a sequence attending causally over its ``len(k)`` keys, written out by hand."""
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    query_positions = torch.arange(len(k) - len(q), len(k))
    scores = scores.masked_fill(torch.arange(len(k))[None, :] > query_positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _slots(block_table: list[int], positions: range) -> list[int]:
    return [block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_paged_step_matches_causal_attention_with_a_prefix_written_in_the_same_step(backend):
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    layer = 1
    key_cache, value_cache = (torch.zeros(2, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(2))
    # a: 10 new tokens. b: shares a's first 8 tokens (two full blocks that a writes in this very step), then 3 of its
    # own. c: 5 tokens cached by an earlier step, 1 new (a decode step).
    a_k, a_v = randn(10, KV_HEADS, HEAD_DIM), randn(10, KV_HEADS, HEAD_DIM)
    b_k = torch.cat([a_k[:8], randn(3, KV_HEADS, HEAD_DIM)])
    b_v = torch.cat([a_v[:8], randn(3, KV_HEADS, HEAD_DIM)])
    c_k, c_v = randn(6, KV_HEADS, HEAD_DIM), randn(6, KV_HEADS, HEAD_DIM)
    tables = {"a": [0, 1, 2], "b": [0, 1, 3], "c": [5, 4]}
    for cache, cached in ((key_cache, c_k[:5]), (value_cache, c_v[:5])):
        cache[layer].view(-1, KV_HEADS, HEAD_DIM)[_slots(tables["c"], range(5))] = cached
    new = {"a": range(0, 10), "b": range(8, 11), "c": range(5, 6)}
    queries = {name: randn(len(span), HEADS, HEAD_DIM) for name, span in new.items()}

    paged = PagedKV(
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.tensor([s for name in "abc" for s in _slots(tables[name], new[name])]),
        block_tables=torch.tensor([tables["a"], tables["b"], tables["c"] + [0]], dtype=torch.int32),
        context_lens=torch.tensor([10, 11, 6], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 10, 13, 14], dtype=torch.int32),
        max_seqlen_q=10,
        max_context_len=11,
    )
    batch = AttentionBatch.build(
        batch_size=1,
        seq_len=14,
        attention_mask=None,
        cu_seqlens=None,
        backend=backend,
        device=torch.device("cpu"),
        dtype=torch.float32,
        paged=paged,
    )
    q = torch.cat([queries[name] for name in "abc"])[None]
    k = torch.cat([a_k, b_k[8:], c_k[5:]])[None]
    v = torch.cat([a_v, b_v[8:], c_v[5:]])[None]
    out = attend(q, k, v, batch, scale=SCALE, layer_index=layer)[0]

    expected = torch.cat(
        [_reference(queries["a"], a_k, a_v), _reference(queries["b"], b_k, b_v), _reference(queries["c"], c_k, c_v)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not key_cache[0].any() and not value_cache[0].any(), "only the given layer's cache is written"
    torch.testing.assert_close(key_cache[layer].view(-1, KV_HEADS, HEAD_DIM)[_slots(tables["b"], range(11))], b_k)


def test_paged_batch_needs_one_row_of_new_tokens_and_a_layer_index():
    cache = torch.zeros(1, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    paged = PagedKV(
        key_cache=cache,
        value_cache=cache.clone(),
        slot_mapping=torch.tensor([0, 1]),
        block_tables=torch.tensor([[0]], dtype=torch.int32),
        context_lens=torch.tensor([2], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32),
        max_seqlen_q=2,
        max_context_len=2,
    )
    build = dict(
        attention_mask=None,
        cu_seqlens=None,
        backend="sdpa",
        device=torch.device("cpu"),
        dtype=torch.float32,
        paged=paged,
    )
    with pytest.raises(ValueError, match="packs its 2 new tokens in one row"):
        AttentionBatch.build(batch_size=2, seq_len=1, **build)
    batch = AttentionBatch.build(batch_size=1, seq_len=2, **build)
    q, kv = torch.zeros(1, 2, HEADS, HEAD_DIM), torch.zeros(1, 2, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="layer_index"):
        attend(q, kv, kv, batch, scale=SCALE)
