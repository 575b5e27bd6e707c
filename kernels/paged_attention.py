"""Paged-attention decode: one query token per sequence attends over its whole context, read through its block table.

A decode step of the generation engine gives every running sequence exactly one new token. The torch path gathers
each sequence's cache blocks into a padded ``[num_seqs, kv_heads, max_context, head_dim]`` copy before attending;
this kernel reads the blocks in place instead. One program serves one (sequence, KV head) pair and all the query heads
that share that KV head (GQA), so each cached key and value is loaded once per step. It walks the context in tiles of
``BLOCK_TOKENS`` tokens with an online softmax (running max and sum, float32 accumulator), so its memory does not grow
with the context length.

Split-K: with few (sequence, KV head) pairs (batch-1 decode has one per KV head: two programs on a GPU of 132
multiprocessors) one program's walk over the context is a chain of dependent loads, its latency the kernel's time
(9.3 us per layer for a 256-token context on an H100, session 38, where the KV read needs well under one). There the
context is split over ``splits`` programs per pair (``decode_splits``: as many as fill the GPU, at most one per tile of
the longest context the block table can hold, so the choice is fixed for a captured graph), each writing its
unnormalised float32 output, running max and sum, and the pair's last program to finish combines them (it counts
the pair's arrivals: ``PagedConfig.last_combines``; else a second kernel does). Each split's share is computed
on the device from the sequence's own length, so short contexts leave the trailing splits empty (they write nothing
to combine) rather than unbalanced.

Fused cache write: a decode step's new keys and values (``new_keys``, ``new_values`` with their ``slots``) can be
passed to the kernel instead of written into the cache first: the program whose tiles hold a sequence's last position
takes them from registers there instead of the cache, then stores them in their slot (so no program depends on
another's store). That is two fewer kernels per layer and step (the engine's
two ``index_copy_`` of a separate write), each about as long as the attention itself at batch 1.

Fused rotation: with the fused write, q and the new keys can also arrive unrotated, with the step's rotary tables
(``rope``: each sequence's cos and sin at its new position); every program rotates its q heads and the new key as it
loads them (rotate-half layout, float32, rounded once to their dtypes), so the step needs no rotation kernel of its own.

Layouts are the engine's (``spmd_rlhf.models.paged_kv.PagedKV``): one layer's cache is
``[num_blocks, block_size, kv_heads, head_dim]``, token ``t`` of sequence ``s`` lives in block
``block_tables[s, t // block_size]`` at offset ``t % block_size``, and query head ``h`` reads KV head
``h // (heads // kv_heads)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from spmd_rlhf.kernels.triton_support import (
    arrival_counts,
    dependent_launch_option,
    launch_device,
    multiprocessors,
    triton,
    use_triton,
)

if triton is not None:
    from spmd_rlhf.kernels.paged_attention_programs import combine_splits_kernel, paged_decode_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MIN_DOT_SIZE = 16
"""``tl.dot`` needs every matrix dimension to be at least 16, so query-head groups and head dims are padded to it."""

BLOCK_TOKENS = 64
"""Context tokens per tile: enough to keep the tensor-core dots busy, few enough for the tile to stay in registers."""


MAX_SPLITS = 32
"""Most programs one (sequence, KV head) pair is split over: the combine reads every split's partial output."""


@dataclass(frozen=True)
class PagedConfig:
    """How the decode kernel tiles its walk: the defaults are reasoned, not measured;
    ``benchmarks/gpu_paged_sweep.py`` times alternatives on a GPU."""

    block_tokens: int = BLOCK_TOKENS
    """Context tokens per tile (a power of two of at least 16, the dots' smallest side)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Tiles in flight (Triton's ``num_stages``, its default 3): compiled for sm_90 as the JIT specialises the
    engine's launches, the walk's block-table, key and value loads are asynchronous copies pipelined this deep
    (``benchmarks/kernel_resources.py``); 1 turns the pipelining off."""
    last_combines: bool = True
    """Split-K's combine done by each pair's last program to finish (an arrival count per pair), not by a second
    kernel: on an H200 (session 47) that kernel was 1.7 us of each layer's 8.2 us of batch-1 attention, its launch
    and the wait for it besides (``benchmarks/gpu_paged_sweep.py`` times both)."""
    max_splits: int = MAX_SPLITS
    """The most programs a (sequence, KV head) pair is split over (``decode_splits``; ``MAX_SPLITS`` at most): fewer
    splits walk more tiles each, pipelined, and 1 leaves out the partial results and their combine, the end of a
    batch-1 step's chain of dependent loads."""
    dependent_launch: bool = False
    """Launch the kernel with programmatic dependent launch (``kernels.grid_dependency``; CUDA on Hopper and later,
    not under the interpreter): it may start while the kernel before it finishes. Untimed (session 48);
    ``gpu_paged_sweep.py`` times it."""

    def __post_init__(self) -> None:
        if self.block_tokens < MIN_DOT_SIZE or self.block_tokens & (self.block_tokens - 1):
            raise ValueError(f"PagedConfig.block_tokens={self.block_tokens} must be a power of two of at least 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"PagedConfig.num_warps={self.num_warps} must be a power of two up to 16")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"PagedConfig.num_stages={self.num_stages} must be 1 to 6")
        if not 1 <= self.max_splits <= MAX_SPLITS:
            raise ValueError(f"PagedConfig.max_splits={self.max_splits} must be 1 to {MAX_SPLITS}")


DEFAULT_PAGED_CONFIG = PagedConfig()


def reference_paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """The kernel's definition in plain torch: gather each sequence's blocks, mask past its length, softmax.

    Computes in float32 (float64 for float64 inputs, which the tests use as ground truth) and returns ``q.dtype``.
    A sequence with an empty context (a padding row) gets zeros, as in the kernel.
    """
    num_seqs, heads, head_dim = q.shape
    kv_heads = key_cache.shape[2]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    keys, values = (
        cache[block_tables.long()].flatten(1, 2).to(compute_dtype) for cache in (key_cache, value_cache)
    )  # [num_seqs, max_blocks * block_size, kv_heads, head_dim]
    grouped_q = q.to(compute_dtype).reshape(num_seqs, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", grouped_q, keys) * scale
    valid = torch.arange(keys.shape[1], device=q.device) < context_lens[:, None].long()
    probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(~valid.any(dim=-1)[:, None, None, None], 0.0)
    out = torch.einsum("skgt,stkd->skgd", probs, values)
    return out.reshape(num_seqs, heads, head_dim).to(q.dtype)


def _check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, heads, head_dim] (one decode token per sequence), got {list(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be one layer's [num_blocks, block_size, kv_heads, head_dim], got "
            f"{list(key_cache.shape)} and {list(value_cache.shape)}"
        )
    num_seqs, heads, head_dim = q.shape
    kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the cache has head_dim {key_cache.shape[3]}")
    if heads % kv_heads != 0:
        raise ValueError(f"{heads} query heads are not a multiple of the cache's {kv_heads} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks], got {block_tables.dtype} "
            f"{list(block_tables.shape)}"
        )
    if context_lens.shape != (num_seqs,) or context_lens.dtype != torch.int32:
        raise ValueError(
            f"context_lens must be int32 [num_seqs={num_seqs}], got {context_lens.dtype} {list(context_lens.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(
            f"q, key_cache and value_cache must share one of float16, bfloat16, float32; got {q.dtype}, "
            f"{key_cache.dtype}, {value_cache.dtype}"
        )
    devices = {t.device for t in (q, key_cache, value_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    # The kernel loads each head_dim vector as one contiguous row; every other stride is passed through.
    for name, tensor in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim (stride 1), got strides {tensor.stride()}")


def _check_new_tokens(
    q: torch.Tensor, key_cache: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, slots: torch.Tensor
) -> None:
    expected = (q.shape[0], key_cache.shape[2], key_cache.shape[3])
    for name, tensor in (("new_keys", new_keys), ("new_values", new_values)):
        if tuple(tensor.shape) != expected or tensor.stride(-1) != 1 or tensor.device != q.device:
            raise ValueError(
                f"{name} must be [num_seqs, kv_heads, head_dim] = {list(expected)}, contiguous in head_dim, on "
                f"{q.device}; got {list(tensor.shape)} with strides {tensor.stride()} on {tensor.device}"
            )
    if slots.shape != (q.shape[0],) or slots.dtype != torch.int64 or slots.device != q.device:
        raise ValueError(
            f"slots must be int64 [num_seqs={q.shape[0]}] on {q.device}, got {slots.dtype} {list(slots.shape)} on "
            f"{slots.device}"
        )


def _check_rope(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fused_write: bool) -> None:
    if not fused_write:
        raise ValueError("rope (a rotation in the kernel) needs the fused write: pass new_keys, new_values and slots")
    num_seqs, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"a rotation in the kernel needs an even head_dim, got {head_dim}")
    cos, sin = rope
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_seqs, head_dim) or table.stride(-1) != 1 or table.device != q.device:
            raise ValueError(
                f"rope's {name} must be [num_seqs, head_dim] = {[num_seqs, head_dim]}, contiguous in head_dim, on "
                f"{q.device}; got {list(table.shape)} with strides {table.stride()} on {table.device}"
            )
    if cos.stride() != sin.stride() or cos.dtype != sin.dtype:
        raise ValueError(f"rope's cos and sin must share strides and dtype, got {cos.stride()} and {sin.stride()}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[num_seqs, heads, head_dim]`` rotated by ``cos``, ``sin`` ``[num_seqs, head_dim]`` as the kernel does
    it: ``x * cos + rotate_half(x) * sin`` in float32 (or wider), rounded once to ``x``'s dtype."""
    half = x.shape[-1] // 2
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    rotated = torch.cat((-wide[..., half:], wide[..., :half]), dim=-1)
    return (wide * cos[:, None].to(wide.dtype) + rotated * sin[:, None].to(wide.dtype)).to(x.dtype)


def write_new_tokens(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Stores ``new_keys``, ``new_values`` ``[tokens, kv_heads, head_dim]`` in one layer's cache at ``slots``
    (``block * block_size + offset``): the separate write the fused kernel replaces."""
    for cache, new in ((key_cache, new_keys), (value_cache, new_values)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.to(cache.dtype))


def decode_splits(
    pairs: int, max_tokens: int, processors: int, *, block_tokens: int = BLOCK_TOKENS, max_splits: int = MAX_SPLITS
) -> int:
    """Programs per (sequence, KV head) pair: 1 when the ``pairs`` fill the ``processors``, else enough to fill them,
    at most one per ``block_tokens`` tile of ``max_tokens`` (the block table's capacity) and ``max_splits``."""
    if pairs >= processors:
        return 1
    tiles = -(-max_tokens // block_tokens)
    return max(1, min(processors // max(pairs, 1), tiles, max_splits))


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    backend: str = "auto",
    splits: int | None = None,
    new_keys: torch.Tensor | None = None,
    new_values: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: PagedConfig = DEFAULT_PAGED_CONFIG,
) -> torch.Tensor:
    """Attention of each sequence's one query over its cached context; returns ``[num_seqs, heads, head_dim]``.

    ``q`` ``[num_seqs, heads, head_dim]``; ``key_cache``, ``value_cache`` one layer's
    ``[num_blocks, block_size, kv_heads, head_dim]`` (same dtype as ``q``: float16, bfloat16 or float32);
    ``block_tables`` int32 ``[num_seqs, max_blocks]``; ``context_lens`` int32 ``[num_seqs]``, each at most
    ``max_blocks * block_size`` (not checked: that would wait for the device). ``backend``: ``auto`` (the Triton kernel
    on CUDA when triton is installed, else the torch reference), ``triton`` or ``torch``. ``splits``: programs per
    (sequence, KV head) pair (split-K, see the module docstring); None: ``decode_splits`` for this device.
    ``new_keys``, ``new_values`` ``[num_seqs, kv_heads, head_dim]`` and int64 ``slots`` ``[num_seqs]``, all or none:
    each sequence's new token, stored in the cache at its slot, which must hold the position ``context_lens - 1``
    (the fused write of the module docstring; the torch path writes first, then attends). ``rope``: ``(cos, sin)``
    ``[num_seqs, head_dim]``, with the fused write: q and ``new_keys`` come unrotated and are rotated on the way in
    (the fused rotation; the torch path rotates them first, with ``rotate``). ``config``: the kernel's tiling.
    """
    _check_inputs(q, key_cache, value_cache, block_tables, context_lens)
    fused_write = new_keys is not None
    if fused_write != (new_values is not None) or fused_write != (slots is not None):
        raise ValueError("new_keys, new_values and slots go together: pass all three or none")
    if fused_write:
        _check_new_tokens(q, key_cache, new_keys, new_values, slots)
    if rope is not None:
        _check_rope(q, rope, fused_write)
    if not use_triton(q.device, backend):
        if rope is not None:
            q, new_keys = rotate(q, *rope), rotate(new_keys, *rope)
        if fused_write:
            write_new_tokens(key_cache, value_cache, new_keys, new_values, slots)
        return reference_paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens, scale=scale)
    num_seqs, heads, head_dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    group = heads // kv_heads
    group_pad = max(MIN_DOT_SIZE, triton.next_power_of_2(group))
    head_dim_pad = max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim))
    if splits is None:
        capacity, processors = block_tables.shape[1] * block_size, multiprocessors(q.device)
        splits = decode_splits(
            num_seqs * kv_heads, capacity, processors, block_tokens=config.block_tokens, max_splits=config.max_splits
        )
    # Split-K's partial results, float32 and padded like the kernel's tiles (unused and tiny when splits is 1).
    partial_shape = (num_seqs, kv_heads, splits, group_pad) if splits > 1 else (1, 1, 1, 1)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    partial_out = torch.empty((*partial_shape, head_dim_pad if splits > 1 else 1), dtype=torch.float32, device=q.device)
    if not fused_write:
        # Never read (FUSED_WRITE is off); any tensors of the right kinds keep the launch's signature.
        new_keys, new_values, slots = q, q, context_lens
    cos, sin = rope if rope is not None else (q, q)  # likewise with ROTARY off
    with launch_device(q.device):
        last_combines = splits > 1 and config.last_combines
        arrivals = arrival_counts(q.device, num_seqs * kv_heads) if last_combines else context_lens  # else unread
        paged_decode_kernel[(num_seqs, kv_heads, splits)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            arrivals,
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            new_keys,
            new_values,
            slots,
            cos,
            sin,
            scale * math.log2(math.e),
            out.stride(0),
            out.stride(1),
            q.stride(0),
            q.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            block_tables.stride(0),
            block_tables.stride(1),
            new_keys.stride(0),
            new_keys.stride(1),
            new_values.stride(0),
            new_values.stride(1),
            cos.stride(0),
            block_size,
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_TOKENS=config.block_tokens,
            SPLITS=splits,
            LAST_COMBINES=last_combines,
            FUSED_WRITE=fused_write,
            ROTARY=rope is not None,
            # float32 caches get full-precision dots; TF32 would cost about three decimal digits.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DEPENDENT_LAUNCH=config.dependent_launch,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **dependent_launch_option(config.dependent_launch),
        )
        if splits > 1 and not last_combines:
            combine_splits_kernel[(num_seqs, kv_heads)](
                out,
                partial_out,
                partial_max,
                partial_sum,
                out.stride(0),
                out.stride(1),
                GROUP=group,
                GROUP_PAD=group_pad,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                SPLITS=splits,
                DEPENDENT_LAUNCH=config.dependent_launch,
                **dependent_launch_option(config.dependent_launch),
            )
    return out
