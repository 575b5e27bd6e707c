"""Attention backends agree with each other on every mask layout; unusable choices fail with the fix named."""

from __future__ import annotations

import pytest
import torch

from spmd_rlhf.models import attention
from spmd_rlhf.models.attention import (
    DEFAULT_KV_BLOCK_SIZE,
    FLASH_PAGED_BLOCK_MULTIPLE,
    AttentionBatch,
    attend,
    default_kv_block_size,
    resolve_backend,
)
from spmd_rlhf.models.paged_kv import PagedKV


def _batch(backend: str, *, batch_size: int, seq_len: int, attention_mask=None, cu_seqlens=None) -> AttentionBatch:
    return AttentionBatch.build(
        batch_size=batch_size,
        seq_len=seq_len,
        attention_mask=attention_mask,
        cu_seqlens=cu_seqlens,
        backend=backend,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


@pytest.mark.parametrize("layout", ["causal", "padded", "packed"])
def test_torch_and_sdpa_backends_agree_with_gqa(layout):
    generator = torch.Generator().manual_seed(0)
    batch_size = 1 if layout == "packed" else 3
    q = torch.randn(batch_size, 10, 6, 8, generator=generator)
    k, v = (torch.randn(batch_size, 10, 2, 8, generator=generator) for _ in range(2))
    masks = {
        "causal": {},
        "padded": {"attention_mask": torch.tensor([[1] * 10, [0] * 4 + [1] * 6, [1] * 7 + [0] * 3])},
        "packed": {"cu_seqlens": torch.tensor([0, 3, 10])},
    }
    outputs = {
        backend: attend(q, k, v, _batch(backend, batch_size=batch_size, seq_len=10, **masks[layout]), scale=8**-0.5)
        for backend in ("torch", "sdpa")
    }
    assert torch.isfinite(outputs["torch"]).all()
    torch.testing.assert_close(outputs["torch"], outputs["sdpa"], atol=1e-5, rtol=1e-5)
    if layout == "packed":
        # The second sequence must not see the first: recompute it alone.
        alone = attend(q[:, 3:], k[:, 3:], v[:, 3:], _batch("torch", batch_size=1, seq_len=7), scale=8**-0.5)
        torch.testing.assert_close(outputs["torch"][:, 3:], alone, atol=1e-6, rtol=0)


@pytest.mark.parametrize("long_rows", [False, True])
@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize("lengths", [[3, 7], [4, 5, 4], [1, 1, 8], [10], [2, 9, 1, 16, 5, 3, 4]])
def test_packed_sequences_attend_as_if_alone(backend, lengths, long_rows, monkeypatch):
    """Packed sequences of similar lengths run as right-padded rows, one long among short ones under a
    [total, total] mask; a row longer than MASK_TOKEN_LIMIT (here every row: ``long_rows``) never builds the mask,
    its sequences bucketed by length class. Every way each sequence's output is that of the sequence on its own."""
    if long_rows:
        monkeypatch.setattr(attention, "MASK_TOKEN_LIMIT", 0)
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        batch = _batch(backend, batch_size=1, seq_len=sum(lengths), cu_seqlens=cu_seqlens)
        classes = {(length - 1).bit_length() for length in lengths}  # ceil(log2(length))
        assert batch.allowed is None
        if len(classes) == 1:
            assert batch.length_buckets is None and batch.bucket.length == max(lengths)
        else:
            sizes = [size for size in batch.length_buckets.sizes.tolist() if size[2]]
            assert len(sizes) == len(classes) and sum(tokens for _, _, tokens in sizes) == sum(lengths)
            assert all(length <= 2 * min(n for n in lengths if n > length / 2) for _, length, _ in sizes)
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, total, 6, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, total, 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = attend(q, k, v, _batch(backend, batch_size=1, seq_len=total, cu_seqlens=cu_seqlens), scale=8**-0.5)
    weights = torch.randn(packed.shape, generator=generator)
    grads = torch.autograd.grad((packed * weights).sum(), (q, k, v))
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        parts = [tensor.detach()[:, start:end].requires_grad_() for tensor in (q, k, v)]
        alone = attend(*parts, _batch(backend, batch_size=1, seq_len=end - start), scale=8**-0.5)
        torch.testing.assert_close(packed[:, start:end], alone, atol=1e-6, rtol=0)
        alone_grads = torch.autograd.grad((alone * weights[:, start:end]).sum(), parts)
        for grad, alone_grad in zip(grads, alone_grads):
            torch.testing.assert_close(grad[:, start:end], alone_grad, atol=2e-6, rtol=0)


def test_flash_without_cuda_or_package_names_the_fix():
    with pytest.raises(ValueError, match="pip install 'spmd_rlhf\\[gpu\\]'"):
        resolve_backend("flash", device=torch.device("cpu"), dtype=torch.bfloat16)


def test_auto_falls_back_to_sdpa_on_cpu_and_unknown_backend_is_rejected():
    assert resolve_backend("auto", device=torch.device("cpu"), dtype=torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="choose one of auto, torch, sdpa, flash"):
        resolve_backend("xformers", device=torch.device("cpu"), dtype=torch.float32)


def test_packed_offsets_must_cover_the_row():
    with pytest.raises(ValueError, match="cu_seqlens ends at 8"):
        _batch("sdpa", batch_size=1, seq_len=10, cu_seqlens=torch.tensor([0, 8]))


def test_the_default_block_size_under_flash_takes_its_paged_kernel(monkeypatch):
    """flash-attn reads a paged cache only in blocks of a multiple of 256: the default block size under flash is one,
    so its paged kernel is the path taken (the kernel needs CUDA; a stub records the call here)."""
    assert default_kv_block_size("flash") % FLASH_PAGED_BLOCK_MULTIPLE == 0
    assert default_kv_block_size("sdpa") == default_kv_block_size("torch") == DEFAULT_KV_BLOCK_SIZE
    taken = []
    monkeypatch.setattr(
        attention, "_flash_paged_attention", lambda q, paged, layer_index, scale: taken.append(paged.block_size) or q
    )
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    for block_size in (default_kv_block_size("flash"), DEFAULT_KV_BLOCK_SIZE):
        cache = torch.zeros(1, 2, block_size, 2, 8)
        paged = PagedKV(
            key_cache=cache,
            value_cache=cache.clone(),
            slot_mapping=torch.tensor([0]),
            block_tables=torch.tensor([[0]], dtype=torch.int32),
            context_lens=torch.tensor([1], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
            max_seqlen_q=1,
            max_context_len=1,
        )
        out = attend(q, k, v, AttentionBatch(max_seqlen=1, backend="flash", paged=paged), scale=8**-0.5, layer_index=0)
        assert out.shape == q.shape
    assert taken == [default_kv_block_size("flash")]  # 16-token blocks gather the cache and use SDPA instead
