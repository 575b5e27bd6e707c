"""Paged decode attention: the Triton kernel against its torch reference (on CUDA, and on CPU under Triton's
interpreter), the reference against the engine's gather path, the wrapper's input checks, and ``attend``'s dispatch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_checks import (
    PAGED_INTERPRETER_CASES,
    PAGED_INTERPRETER_DTYPES,
    RELATIVE_TOLERANCE,
    PagedCase,
    check_paged_attention,
    interpreter_unusable_reason,
    run_under_interpreter,
)

import spmd_rlhf.models.attention as attention
from spmd_rlhf.kernels.paged_attention import (
    MAX_SPLITS,
    PagedConfig,
    decode_splits,
    paged_decode_attention,
    reference_paged_decode_attention,
    rotate,
)
from spmd_rlhf.kernels.triton_support import triton_available
from spmd_rlhf.models.attention import AttentionBatch, attend
from spmd_rlhf.models.paged_kv import PagedKV

needs_cuda_and_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA device and triton"
)

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 4, 4, 2, 8


def _decode_step(context_lens: list[int], *, num_layers: int = 2, device: str = "cpu", dtype=torch.float32):
    """A decode step of the engine: sequences with ``context_lens`` tokens (the last one new), their blocks drawn at
    random from a cache whose other slots hold random values; returns the PagedKV and the new tokens' q, k, v."""
    blocks_per_seq = [-(-length // BLOCK_SIZE) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks).tolist()
    tables = []
    for count in blocks_per_seq:
        tables.append(order[:count] + [0] * (max(blocks_per_seq) - count))
        order = order[count:]
    cache_shape = (num_layers, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, device=device).to(dtype)
    last = [length - 1 for length in context_lens]
    slots = [
        table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE for table, position in zip(tables, last)
    ]
    num_seqs = len(context_lens)
    paged = PagedKV(
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.tensor(slots, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        max_seqlen_q=1,
        max_context_len=max(context_lens),
    )
    q, k, v = (
        torch.randn(1, num_seqs, heads, HEAD_DIM, device=device).to(dtype) for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    return paged, q, k, v


def _attend(paged: PagedKV, q, k, v, backend: str, layer: int = 1) -> torch.Tensor:
    batch = AttentionBatch.build(
        batch_size=1,
        seq_len=q.shape[1],
        attention_mask=None,
        cu_seqlens=None,
        backend=backend,
        device=q.device,
        dtype=q.dtype,
        paged=paged,
    )
    return attend(q, k, v, batch, scale=HEAD_DIM**-0.5, layer_index=layer)


def test_reference_equals_the_engine_gather_path_on_a_decode_step():
    paged, q, k, v = _decode_step([5, 1, 11])
    out = _attend(paged, q, k, v, backend="torch")[0]
    # attend wrote the new tokens' K/V into layer 1 first; the reference reads that layer's cache as it now is.
    expected = reference_paged_decode_attention(
        q[0], paged.key_cache[1], paged.value_cache[1], paged.block_tables, paged.context_lens, scale=HEAD_DIM**-0.5
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_falls_back_to_the_reference_and_zeros_an_empty_context():
    paged, _, _, _ = _decode_step([6, 9, 3])
    context_lens = torch.tensor([6, 0, 3], dtype=torch.int32)
    strided_q = torch.randn(3, HEADS, HEAD_DIM + 4)[..., :HEAD_DIM]
    inputs = (strided_q, paged.key_cache[0], paged.value_cache[0], paged.block_tables, context_lens)
    out = paged_decode_attention(*inputs, scale=0.3)
    assert torch.equal(out, reference_paged_decode_attention(*inputs, scale=0.3))
    assert not out[1].any() and out[0].abs().sum() > 0


def test_attend_sends_decode_steps_to_the_kernel_when_triton_applies(monkeypatch):
    calls = []

    def recording_kernel(q, key_cache, value_cache, block_tables, context_lens, *, scale, **new_tokens):
        calls.append((key_cache.data_ptr(), value_cache.data_ptr(), q.shape))
        new_token_calls.append(new_tokens)
        return paged_decode_attention(
            q, key_cache, value_cache, block_tables, context_lens, scale=scale, backend="torch", **new_tokens
        )

    new_token_calls = []
    paged, q, k, v = _decode_step([7, 2, 12])
    # The gather path writes the new tokens first, then reads the cache; the kernel is handed them instead.
    gather_paged = dataclasses.replace(paged, key_cache=paged.key_cache.clone(), value_cache=paged.value_cache.clone())
    expected = _attend(gather_paged, q, k, v, backend="torch")
    monkeypatch.setattr(attention, "use_triton", lambda device, backend: True)
    monkeypatch.setattr(attention, "paged_decode_attention", recording_kernel)

    torch.testing.assert_close(_attend(paged, q, k, v, backend="sdpa"), expected, atol=1e-5, rtol=1e-5)
    assert calls == [(paged.key_cache[1].data_ptr(), paged.value_cache[1].data_ptr(), q[0].shape)]
    (new_tokens,) = new_token_calls
    assert new_tokens["new_keys"] is not None and torch.equal(new_tokens["slots"], paged.slot_mapping)
    assert torch.equal(paged.key_cache, gather_paged.key_cache)
    assert torch.equal(paged.value_cache, gather_paged.value_cache)
    _attend(paged, q, k, v, backend="torch")
    assert len(calls) == 1, "the pure-torch backend keeps the gather path"
    prefill = dataclasses.replace(paged, max_seqlen_q=2)
    _attend(prefill, q, k, v, backend="sdpa")
    assert len(calls) == 1, "a step with several new tokens per sequence is not a decode step"


def _inputs(**overrides):
    inputs = dict(
        q=torch.randn(2, 4, 8),
        key_cache=torch.randn(5, 4, 2, 8),
        value_cache=torch.randn(5, 4, 2, 8),
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        context_lens=torch.tensor([3, 9], dtype=torch.int32),
    )
    return {**inputs, **overrides}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(q=torch.randn(2, 32)), "q must be \\[num_seqs, heads, head_dim\\]"),
        (dict(value_cache=torch.randn(5, 4, 1, 8)), "key_cache and value_cache must both be"),
        (dict(q=torch.randn(2, 4, 16)), "q has head_dim 16 but the cache has head_dim 8"),
        (dict(q=torch.randn(2, 3, 8)), "3 query heads are not a multiple of the cache's 2 KV heads"),
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables must be int32"),
        (dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)), "block_tables must be int32 \\[num_seqs=2"),
        (dict(context_lens=torch.tensor([3], dtype=torch.int32)), "context_lens must be int32 \\[num_seqs=2\\]"),
        (dict(key_cache=torch.randn(5, 4, 2, 8).half()), "must share one of float16, bfloat16, float32"),
        (
            dict(
                q=torch.randn(2, 4, 8).double(),
                key_cache=torch.randn(5, 4, 2, 8).double(),
                value_cache=torch.randn(5, 4, 2, 8).double(),
            ),
            "must share one of float16, bfloat16, float32",
        ),
        (dict(context_lens=torch.tensor([3, 9], dtype=torch.int32, device="meta")), "all inputs must be on one device"),
        (dict(q=torch.randn(2, 8, 4).transpose(1, 2)), "q must be contiguous in head_dim"),
        (dict(key_cache=torch.randn(5, 4, 8, 2).transpose(2, 3)), "key_cache must be contiguous in head_dim"),
    ],
)
def test_bad_inputs_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_inputs(**overrides), scale=1.0)


NEW_TOKENS = dict(new_keys=torch.randn(2, 2, 8), new_values=torch.randn(2, 2, 8), slots=torch.tensor([2, 8]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(slots=None), "new_keys, new_values and slots go together"),
        (dict(new_keys=torch.randn(2, 1, 8)), "new_keys must be \\[num_seqs, kv_heads, head_dim\\] = \\[2, 2, 8\\]"),
        (dict(new_values=torch.randn(2, 8, 2).transpose(1, 2)), "new_values must be .* contiguous in head_dim"),
        (dict(slots=torch.tensor([2, 8], dtype=torch.int32)), "slots must be int64 \\[num_seqs=2\\]"),
    ],
)
def test_bad_new_tokens_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_inputs(), scale=1.0, **{**NEW_TOKENS, **overrides})


ROPE = (torch.randn(2, 8), torch.randn(2, 8))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(new_keys=None, new_values=None, slots=None), "rope .* needs the fused write"),
        (dict(rope=(torch.randn(2, 4), torch.randn(2, 4))), "rope's cos must be \\[num_seqs, head_dim\\] = \\[2, 8\\]"),
        (dict(rope=(ROPE[0], torch.randn(8, 2).t())), "rope's sin must be .* contiguous in head_dim"),
        (dict(rope=(ROPE[0], torch.randn(2, 16)[:, :8])), "rope's cos and sin must share strides and dtype"),
    ],
)
def test_bad_rotary_tables_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_inputs(), scale=1.0, **{**NEW_TOKENS, "rope": ROPE, **overrides})


def test_an_odd_head_dim_cannot_be_rotated_in_the_kernel():
    inputs = _inputs(q=torch.randn(2, 4, 7), key_cache=torch.randn(5, 4, 2, 7), value_cache=torch.randn(5, 4, 2, 7))
    new_tokens = dict(new_keys=torch.randn(2, 2, 7), new_values=torch.randn(2, 2, 7), slots=torch.tensor([2, 8]))
    with pytest.raises(ValueError, match="needs an even head_dim, got 7"):
        paged_decode_attention(**inputs, scale=1.0, rope=(torch.randn(2, 7), torch.randn(2, 7)), **new_tokens)


def test_the_torch_path_rotates_then_writes_the_new_tokens_before_attending():
    inputs = _inputs()
    out = paged_decode_attention(**inputs, scale=1.0, backend="torch", rope=ROPE, **NEW_TOKENS)
    rotated_keys = rotate(NEW_TOKENS["new_keys"], *ROPE)
    assert torch.equal(inputs["key_cache"].view(-1, 2, 8)[NEW_TOKENS["slots"]], rotated_keys)
    rotated_q = rotate(inputs.pop("q"), *ROPE)
    assert torch.equal(out, reference_paged_decode_attention(rotated_q, **inputs, scale=1.0))


def test_the_torch_path_writes_the_new_tokens_before_attending():
    inputs = _inputs()
    out = paged_decode_attention(**inputs, scale=1.0, backend="torch", **NEW_TOKENS)
    flat_keys = inputs["key_cache"].view(-1, 2, 8)
    assert torch.equal(flat_keys[NEW_TOKENS["slots"]], NEW_TOKENS["new_keys"])
    assert torch.equal(inputs["value_cache"].view(-1, 2, 8)[NEW_TOKENS["slots"]], NEW_TOKENS["new_values"])
    assert torch.equal(out, reference_paged_decode_attention(**inputs, scale=1.0))


def test_split_k_fills_the_gpu_only_where_few_pairs_would_leave_it_idle():
    """Batch-1 decode of a 2-KV-head model on 132 multiprocessors: one program per 64-token tile of the block table's
    capacity, at most MAX_SPLITS; 64 pairs get 2 each; from 132 pairs on, one."""
    assert decode_splits(2, 256, 132) == 4  # a 256-token table: 4 tiles
    assert decode_splits(2, 32_768, 132) == MAX_SPLITS
    assert decode_splits(64, 32_768, 132) == 2  # 132 // 64
    assert decode_splits(132, 32_768, 132) == decode_splits(512, 32_768, 132) == 1
    assert decode_splits(2, 0, 132) == 1
    assert decode_splits(2, 256, 132, block_tokens=32) == 8  # a tiling of 32-token tiles: 8 of them
    assert decode_splits(2, 256, 132, max_splits=2) == 2 and decode_splits(2, 32_768, 132, max_splits=1) == 1


@pytest.mark.parametrize(
    "fields",
    [
        dict(block_tokens=8),
        dict(block_tokens=48),
        dict(num_warps=3),
        dict(num_stages=0),
        dict(max_splits=0),
        dict(max_splits=MAX_SPLITS + 1),
    ],
)
def test_a_tiling_the_kernel_cannot_run_is_refused(fields):
    with pytest.raises(ValueError, match="PagedConfig"):
        PagedConfig(**fields)


@pytest.mark.skipif(interpreter_unusable_reason() is not None, reason=str(interpreter_unusable_reason()))
def test_kernel_matches_the_reference_under_the_triton_interpreter():
    passed = run_under_interpreter("paged_attention")
    assert len(passed) == len(PAGED_INTERPRETER_CASES) * len(PAGED_INTERPRETER_DTYPES), passed


CUDA_CASES = [
    PagedCase(heads=32, kv_heads=8, head_dim=128, block_size=16, context_lens=(1, 17, 640, 2049, 64, 1000) * 8),
    PagedCase(heads=28, kv_heads=4, head_dim=128, block_size=16, context_lens=(3000, 5, 0, 129), strided_q=True),
    PagedCase(heads=16, kv_heads=16, head_dim=64, block_size=256, context_lens=(300, 1, 700)),
    PagedCase(heads=14, kv_heads=2, head_dim=96, block_size=5, context_lens=(33, 98, 7)),
    PagedCase(heads=12, kv_heads=2, head_dim=128, block_size=16, context_lens=(300,), fused_write=True),
    PagedCase(heads=28, kv_heads=4, head_dim=128, block_size=16, context_lens=(3000, 5, 0, 129), fused_write=True),
    PagedCase(heads=12, kv_heads=2, head_dim=128, block_size=16, context_lens=(300,), fused_write=True, rotary=True),
    # Programmatic dependent launch (Hopper and later; the case skips itself before).
    PagedCase(
        heads=12,
        kv_heads=2,
        head_dim=128,
        block_size=16,
        context_lens=(300, 4000),
        fused_write=True,
        rotary=True,
        config=PagedConfig(dependent_launch=True),
    ),
    PagedCase(
        heads=28,
        kv_heads=4,
        head_dim=128,
        block_size=16,
        context_lens=(3000, 5, 0, 129),
        strided_q=True,
        fused_write=True,
        rotary=True,
    ),
]


@needs_cuda_and_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_cuda_kernel_matches_the_reference(case, dtype):
    if case.config.dependent_launch and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    check_paged_attention(case, dtype, "cuda", "auto")
    check_paged_attention(case, dtype, "cuda", "triton")


@needs_cuda_and_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_step_through_attend_matches_the_gather_path(dtype):
    paged, q, k, v = _decode_step([1, 40, 300, 17], device="cuda", dtype=dtype)
    gather_paged = dataclasses.replace(paged, key_cache=paged.key_cache.clone(), value_cache=paged.value_cache.clone())
    out = _attend(paged, q, k, v, backend="sdpa")
    expected = _attend(gather_paged, q, k, v, backend="torch")
    error = float((out.double() - expected.double()).norm() / expected.double().norm())
    assert error < RELATIVE_TOLERANCE[dtype], error
    # The kernel's fused write stored the new tokens as the separate write of the gather path did.
    assert torch.equal(paged.key_cache, gather_paged.key_cache)
    assert torch.equal(paged.value_cache, gather_paged.value_cache)
