"""Attention backends behind one call, chosen at run time: pure torch, SDPA, flash-attn, and for the generation
engine's decode steps on CUDA the Triton paged-decode kernel (``spmd_rlhf.kernels.paged_attention``).

The decoder layer computes q, k, v and hands them to ``attend`` together with an ``AttentionBatch`` that says which
keys each query may see (padded rows or packed sequences, or, for the generation engine, a paged KV cache that the
new keys are written into and the whole context is read from). The layer code is the same for training and generation.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from spmd_rlhf.kernels.paged_attention import paged_decode_attention
from spmd_rlhf.kernels.triton_support import use_triton
from spmd_rlhf.models.length_buckets import LengthBuckets, OneLengthClass, bucketed_attention, length_buckets
from spmd_rlhf.models.paged_kv import PagedKV

BACKENDS = ("auto", "torch", "sdpa", "flash")

FLASH_PAGED_BLOCK_MULTIPLE = 256
"""flash-attn 2 reads a paged cache only when the block size is a multiple of this; other block sizes gather the
cached blocks and use SDPA instead."""
MASK_TOKEN_LIMIT = 4096
"""Packed rows longer than this never attend under one ``[total, total]`` mask (16 MiB of booleans at the limit,
growing with the square, and the backends copy it): their sequences run as right-padded rows grouped by length
class (``models.length_buckets``), which needs the row's offsets on the host once per forward."""
DEFAULT_KV_BLOCK_SIZE = 16
"""KV block size of the engine when flash-attn does not read the cache: small blocks waste little of a sequence's
last block."""


def default_kv_block_size(backend: str) -> int:
    """The paged-KV block size for a resolved attention ``backend``: flash-attn's smallest paged block when it reads
    the cache (``_flash_paged_attention``), else ``DEFAULT_KV_BLOCK_SIZE``."""
    return FLASH_PAGED_BLOCK_MULTIPLE if backend == "flash" else DEFAULT_KV_BLOCK_SIZE


def flash_attn_available() -> bool:
    """True when the optional ``flash-attn`` package (extra ``gpu``) is importable."""
    return importlib.util.find_spec("flash_attn") is not None


@dataclass(frozen=True)
class SequenceBucket:
    """A packed row's sequences attended together as right-padded rows ``[rows, length]``."""

    slots: tuple[torch.Tensor, torch.Tensor]
    """Each of those tokens' (row, position in it) in the padded rows."""
    rows: int
    length: int


@dataclass(frozen=True)
class AttentionBatch:
    """Which keys each query may attend to, for one forward pass.

    Exactly one layout applies:
      * dense causal: ``attention_mask`` and ``cu_seqlens`` both None;
      * padded rows: ``attention_mask`` ``[batch, seq]``, True / 1 at real tokens (left or right padding);
      * packed: ``cu_seqlens`` ``[num_seqs + 1]`` int32 offsets of sequences laid end to end in one row;
      * paged (generation): ``paged`` says where the new tokens of one row write their K/V in the cache and which
        cached keys each of them reads.
    """

    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    backend: str = "sdpa"
    paged: PagedKV | None = None
    allowed: torch.Tensor | None = None
    """Dense backends: the boolean ``[batch or 1, 1, seq, seq]`` mask (True = may attend) of padded rows or of packed
    sequences in one masked attention, built once per forward for every layer; None: plain causal attention."""
    bucket: SequenceBucket | None = None
    """Dense backends, packed sequences attended as right-padded rows ``[num_seqs, max_seqlen]`` instead of one masked
    attention (``build`` says when), built once per forward."""
    length_buckets: LengthBuckets | None = None
    """Dense backends, a row longer than ``MASK_TOKEN_LIMIT`` whose sequences span several power-of-two length
    classes: right-padded rows per class (``models.length_buckets``), built once per forward."""
    decode_kernel: bool = False
    """A paged decode step (one new token per sequence) that the Triton kernel runs, reading the cache in place and
    writing the new K/V itself: decided once per step by ``build``."""
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    """With ``decode_kernel``: the step's rotary tables ``(cos, sin)`` ``[tokens, head_dim]``, which the kernel
    applies to q and k as it loads them, so the layers hand them on unrotated (``Backbone.forward`` moves the tables
    here)."""

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
        paged: PagedKV | None = None,
        max_seqlen: int | None = None,
        length_classes: LengthBuckets | OneLengthClass | None = None,
    ) -> AttentionBatch:
        """``max_seqlen``: the longest packed sequence's length when the caller knows it on the host (a packer does);
        otherwise it is read back from ``cu_seqlens``, a device sync (and a graph break under ``torch.compile``).
        ``length_classes``: a row over ``MASK_TOKEN_LIMIT`` tokens grouped by length class on the host (a packer's),
        or found to span one; otherwise, and when the row's length is not theirs (padded since), they are built from
        ``cu_seqlens`` read back from the device."""
        if attention_mask is not None and cu_seqlens is not None:
            raise ValueError("pass either attention_mask (padded rows) or cu_seqlens (packed sequences), not both")
        if backend == "auto":
            # A named backend is taken as given: whoever named it checked it against the dtype the layers compute in,
            # which weights still sharded (FSDP's, outside their unit's forward) do not show.
            backend = resolve_backend(backend, device=device, dtype=dtype)
        if paged is not None:
            if attention_mask is not None or cu_seqlens is not None:
                raise ValueError("a paged KV batch describes its own sequences; pass no attention_mask or cu_seqlens")
            if batch_size != 1 or paged.slot_mapping.shape[0] != seq_len:
                raise ValueError(
                    f"a paged KV step packs its {paged.slot_mapping.shape[0]} new tokens in one row, got input "
                    f"[{batch_size}, {seq_len}]"
                )
            kernel = _is_triton_decode(seq_len, paged, backend, dtype=dtype, device=device)
            return AttentionBatch(max_seqlen=paged.max_seqlen_q, backend=backend, paged=paged, decode_kernel=kernel)
        if cu_seqlens is not None:
            if batch_size != 1:
                raise ValueError(f"packed sequences go in one row (batch size 1), got batch size {batch_size}")
            cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
            if max_seqlen is None:
                if int(cu_seqlens[-1]) != seq_len:
                    raise ValueError(
                        f"cu_seqlens ends at {int(cu_seqlens[-1])} but the packed row has {seq_len} tokens"
                    )
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        else:
            max_seqlen = seq_len
        if attention_mask is not None:
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            if bool(attention_mask.all()):
                attention_mask = None
        batch = AttentionBatch(attention_mask, cu_seqlens, max_seqlen, backend)
        if backend == "flash":
            return batch
        # What every layer's dense attention reads, built here once: per layer it was a dozen small ops (and inside a
        # compiled block, index arithmetic in every block's graph).
        if cu_seqlens is not None and seq_len > MASK_TOKEN_LIMIT:
            given = length_classes is not None and length_classes.total == seq_len
            classes = length_classes if given else length_buckets(cu_seqlens, seq_len)
            if isinstance(classes, LengthBuckets):
                return replace(batch, length_buckets=classes)
        if cu_seqlens is not None and (seq_len > MASK_TOKEN_LIMIT or _per_sequence_is_cheaper(batch, seq_len)):
            slots = _sequence_slots(cu_seqlens, seq_len)
            return replace(batch, bucket=SequenceBucket(slots, cu_seqlens.shape[0] - 1, max_seqlen))
        return replace(batch, allowed=_allowed_keys(batch, seq_len, device))


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


def _torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float
) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is None:
        seq_len = q.shape[-2]
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    batch_size, seq_len = q.shape[:2]
    if batch.attention_mask is None and batch.cu_seqlens is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    if batch.cu_seqlens is not None:
        out = flash_attn_varlen_func(
            q[0],
            k[0],
            v[0],
            batch.cu_seqlens,
            batch.cu_seqlens,
            batch.max_seqlen,
            batch.max_seqlen,
            softmax_scale=scale,
            causal=True,
        )
        return out[None]
    # Padded rows: drop the padding, run varlen attention over the real tokens, scatter back.
    lengths = batch.attention_mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    keep = batch.attention_mask.flatten().nonzero().squeeze(1)
    flat = [t.reshape(batch_size * seq_len, *t.shape[2:]).index_select(0, keep) for t in (q, k, v)]
    out = flash_attn_varlen_func(
        *flat, cu_seqlens, cu_seqlens, int(lengths.max()), int(lengths.max()), softmax_scale=scale, causal=True
    )
    full = out.new_zeros(batch_size * seq_len, *out.shape[1:])
    return full.index_copy(0, keep, out).view(batch_size, seq_len, *out.shape[1:])


def _flash_paged_attention(q: torch.Tensor, paged: PagedKV, layer_index: int, scale: float) -> torch.Tensor:
    """flash-attn reading K/V straight from the cache blocks: taken when the engine's block size is a multiple of
    ``FLASH_PAGED_BLOCK_MULTIPLE``, as ``default_kv_block_size("flash")`` makes it (CUDA only:
    tests/engine/test_gpu_engine.py)."""
    from flash_attn import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q[0],
        paged.key_cache[layer_index],
        paged.value_cache[layer_index],
        paged.cu_seqlens_q,
        paged.cu_seqlens_k,
        paged.max_seqlen_q,
        paged.max_context_len,
        softmax_scale=scale,
        causal=True,
        block_table=paged.block_tables,
    )
    return out[None]


def flash_reads_paged(backend: str, block_size: int) -> bool:
    """Whether flash-attn's paged kernel reads the cache: the flash backend at a block size it takes
    (``FLASH_PAGED_BLOCK_MULTIPLE``)."""
    return backend == "flash" and block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0


def _is_triton_decode(tokens: int, paged: PagedKV, backend: str, *, dtype: torch.dtype, device: torch.device) -> bool:
    """A decode step (one new token per sequence) on CUDA reads the cache blocks in place with the Triton kernel,
    instead of gathering them into a padded copy; the pure-torch backend keeps the gather path, and flash-attn's
    paged kernel takes the block sizes it reads."""
    one_token_per_sequence = paged.max_seqlen_q == 1 and tokens == paged.context_lens.shape[0]
    return (
        backend != "torch"
        and not flash_reads_paged(backend, paged.block_size)
        and one_token_per_sequence
        and dtype == paged.key_cache.dtype
        and use_triton(device, "auto")
    )


def _paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, layer_index: int, scale: float
) -> torch.Tensor:
    paged = batch.paged
    if batch.decode_kernel:
        # The kernel stores the new token's K/V itself (its fused write: two launches fewer per layer and step) and,
        # given the step's tables, rotates q and k (one fewer).
        out = paged_decode_attention(
            q[0],
            paged.key_cache[layer_index],
            paged.value_cache[layer_index],
            paged.block_tables,
            paged.context_lens,
            scale=scale,
            new_keys=k[0],
            new_values=v[0],
            slots=paged.slot_mapping,
            rope=batch.rope,
            config=paged.kernel_tiling,
        )
        return out[None]
    paged.write(layer_index, k[0], v[0])
    if flash_reads_paged(batch.backend, paged.block_size):
        return _flash_paged_attention(q, paged, layer_index, scale)
    padded_q, cached_k, cached_v, allowed = paged.gather(layer_index, q[0])
    backend = "torch" if batch.backend == "torch" else "sdpa"
    return paged.unpad(_dense_attention(padded_q, cached_k, cached_v, allowed, backend, scale))[None]


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, backend: str, scale: float
) -> torch.Tensor:
    """``q`` ``[b, heads, s, d]`` over ``k, v`` ``[b, kv_heads, keys, d]`` where ``allowed`` (None: causal)."""
    if backend == "torch":
        return _torch_attention(q, k, v, allowed, scale)
    # A branch, not the comparison itself: under a compiled block whose head counts are symbolic (FSDP's parameters)
    # the comparison is a SymBool, which SDPA does not take; a branch is decided (and guarded) while tracing.
    grouped = True if k.shape[1] != q.shape[1] else False  # noqa: SIM210
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=scale, enable_gqa=grouped
    )


def _per_sequence_is_cheaper(batch: AttentionBatch, total: int) -> bool:
    """For packed sequences on a dense backend: whether right-padded rows (``num_seqs * max_seqlen**2`` scores) cost
    less than one masked ``[total, total]`` attention. Sequences of similar lengths make it ``num_seqs`` times
    cheaper; one long sequence beside many short ones keeps the mask."""
    num_seqs = batch.cu_seqlens.shape[0] - 1
    return num_seqs * batch.max_seqlen**2 < total**2


def _sequence_slots(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of a packed row's ``total`` tokens' (sequence, position in it): its slot in right-padded rows."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)
    return sequence, torch.arange(total, device=cu_seqlens.device) - starts[sequence]


def _per_sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """Packed sequences ``[1, total, heads, d]`` through a dense backend as right-padded rows ``[num_seqs,
    max_seqlen]``, with plain causal attention (a right-padded row's real queries see only real keys, so no mask is
    built); returns ``[1, total, heads, d]``. Holds padded copies of q, k, v and the output."""
    bucket = batch.bucket

    def rows(tensor: torch.Tensor) -> torch.Tensor:
        padded = tensor.new_zeros(bucket.rows, bucket.length, *tensor.shape[2:])
        return padded.index_put(bucket.slots, tensor[0]).transpose(1, 2)

    out = _dense_attention(rows(q), rows(k), rows(v), None, batch.backend, scale)
    return out.transpose(1, 2)[bucket.slots][None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    *,
    scale: float,
    layer_index: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[b, s, heads, d]`` over ``k, v`` ``[b, s, kv_heads, d]``; returns ``[b, s, heads,
    d]``.

    With a paged batch, ``k, v`` are the new tokens' keys and values: they are written into layer ``layer_index``'s
    cache and ``q`` attends over each sequence's whole cached context.
    """
    if batch.paged is not None:
        if layer_index is None:
            raise ValueError("a paged KV batch needs the layer_index of the cache to read and write")
        return _paged_attention(q, k, v, batch, layer_index, scale)
    if batch.backend == "flash":
        return _flash_attention(q, k, v, batch, scale)
    if batch.length_buckets is not None:
        return bucketed_attention(q, k, v, batch.length_buckets, batch.backend, scale)
    if batch.bucket is not None:
        return _per_sequence_attention(q, k, v, batch, scale)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _dense_attention(q, k, v, batch.allowed, batch.backend, scale).transpose(1, 2)
