"""Attention backends behind one call, chosen at run time: pure torch, SDPA, flash-attn.

The decoder layer computes q, k, v and hands them to ``attend`` together with an ``AttentionBatch`` that says which
keys each query may see (padded rows or packed sequences). The paged-KV path of the generation engine slots in as
another kind of batch description handled here, so the layer code stays the same for training and generation.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "torch", "sdpa", "flash")


def flash_attn_available() -> bool:
    """True when the optional ``flash-attn`` package (extra ``gpu``) is importable."""
    return importlib.util.find_spec("flash_attn") is not None


@dataclass(frozen=True)
class AttentionBatch:
    """Which keys each query may attend to, for one forward pass.

    Exactly one layout applies:
      * dense causal: ``attention_mask`` and ``cu_seqlens`` both None;
      * padded rows: ``attention_mask`` ``[batch, seq]``, True / 1 at real tokens (left or right padding);
      * packed: ``cu_seqlens`` ``[num_seqs + 1]`` int32 offsets of sequences laid end to end in one row.
    """

    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    backend: str = "sdpa"

    @staticmethod
    def build(
        *,
        batch_size: int,
        seq_len: int,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        backend: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> AttentionBatch:
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("pass either attention_mask (padded rows) or cu_seqlens (packed sequences), not both")
        if cu_seqlens is not None:
            if batch_size != 1:
                raise ValueError(f"packed sequences go in one row (batch size 1), got batch size {batch_size}")
            if int(cu_seqlens[-1]) != seq_len:
                raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but the packed row has {seq_len} tokens")
            cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        else:
            max_seqlen = seq_len
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            if bool(attention_mask.all()):
                attention_mask = None
        return AttentionBatch(attention_mask, cu_seqlens, max_seqlen, resolve_backend(backend, device=device, dtype=dtype))


def resolve_backend(backend: str, *, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` picks flash-attn on CUDA with a 16-bit dtype when installed, else SDPA."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    flash_usable = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_attn_available()
    if backend == "flash" and not flash_usable:
        raise ValueError(
            "attention backend 'flash' needs CUDA, a float16/bfloat16 model and the flash-attn package "
            "(pip install 'spmd_rlhf[gpu]'); use 'auto' to fall back to SDPA"
        )
    if backend == "auto":
        return "flash" if flash_usable else "sdpa"
    return backend


def _allowed_keys(batch: AttentionBatch, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[batch or 1, 1, seq, seq]`` mask (True = may attend), or None for plain causal attention."""
    if batch.attention_mask is None and batch.cu_seqlens is None:
        return None
    positions = torch.arange(seq_len, device=device)
    allowed = positions[:, None] >= positions[None, :]
    if batch.cu_seqlens is not None:
        segment = torch.bucketize(positions, batch.cu_seqlens[1:], right=True)
        allowed = allowed & (segment[:, None] == segment[None, :])
        return allowed[None, None]
    allowed = allowed[None] & batch.attention_mask[:, None, :]
    # A padding query would see no key at all; letting it see itself keeps softmax finite (its output is unused).
    allowed = allowed | torch.eye(seq_len, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is None:
        seq_len = q.shape[-2]
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    batch_size, seq_len = q.shape[:2]
    if batch.attention_mask is None and batch.cu_seqlens is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    if batch.cu_seqlens is not None:
        out = flash_attn_varlen_func(
            q[0], k[0], v[0], batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen,
            softmax_scale=scale, causal=True,
        )
        return out[None]
    # Padded rows: drop the padding, run varlen attention over the real tokens, scatter back.
    lengths = batch.attention_mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    keep = batch.attention_mask.flatten().nonzero().squeeze(1)
    flat = [t.reshape(batch_size * seq_len, *t.shape[2:]).index_select(0, keep) for t in (q, k, v)]
    out = flash_attn_varlen_func(*flat, cu_seqlens, cu_seqlens, int(lengths.max()), int(lengths.max()), softmax_scale=scale, causal=True)
    full = out.new_zeros(batch_size * seq_len, *out.shape[1:])
    return full.index_copy(0, keep, out).view(batch_size, seq_len, *out.shape[1:])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, *, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[b, s, heads, d]`` over ``k, v`` ``[b, s, kv_heads, d]``; returns ``[b, s, heads, d]``."""
    if batch.backend == "flash":
        return _flash_attention(q, k, v, batch, scale)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    allowed = _allowed_keys(batch, q.shape[-2], q.device)
    if batch.backend == "torch":
        out = _torch_attention(q, k, v, allowed, scale)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    return out.transpose(1, 2)
