"""The Triton programs of ``paged_attention``: the decode kernel (one program per sequence, KV head and split, with
its online softmax, split-K partial results and their combine by each pair's last program to finish, fused cache
write and rotation) and split-K's combine as a kernel of its own. The module docstring of ``paged_attention``
describes them; its ``paged_decode_attention`` checks the inputs and launches them. Imported only where triton is
installed."""

from __future__ import annotations

from spmd_rlhf.kernels.arrival_programs import last_to_arrive, reset_arrivals
from spmd_rlhf.kernels.grid_dependency import wait_for_the_kernel_before
from spmd_rlhf.kernels.triton_support import tl, triton


@triton.jit
def paged_decode_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    arrivals_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    new_keys_ptr,
    new_values_ptr,
    slots_ptr,
    cos_ptr,
    sin_ptr,
    scale_log2,
    stride_out_seq,
    stride_out_head,
    stride_q_seq,
    stride_q_head,
    stride_key_block,
    stride_key_token,
    stride_key_head,
    stride_value_block,
    stride_value_token,
    stride_value_head,
    stride_table_seq,
    stride_table_block,
    stride_new_key_seq,
    stride_new_key_head,
    stride_new_value_seq,
    stride_new_value_head,
    stride_rope_seq,
    block_size,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    SPLITS: tl.constexpr,
    LAST_COMBINES: tl.constexpr,
    FUSED_WRITE: tl.constexpr,
    ROTARY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    wait_for_the_kernel_before(DEPENDENT_LAUNCH)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # This program's share of the context: whole tiles, the same count for every split of the sequence.
    share = tl.cdiv(tl.cdiv(context_len, SPLITS), BLOCK_TOKENS) * BLOCK_TOKENS
    first = split * share
    end = tl.minimum(context_len, first + share)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + group
    head_dim_mask = dims < HEAD_DIM
    q_mask = (group < GROUP)[:, None] & head_dim_mask[None, :]
    q_rows = q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
    q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if ROTARY:
        # q and the new key arrive unrotated: x * cos + rotate_half(x) * sin, rotate_half(x) being x's other half
        # (the first half negated), in float32 and rounded once, as a fused rotation kernel would store them.
        half = HEAD_DIM // 2
        partner = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + seq * stride_rope_seq + dims, mask=head_dim_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + seq * stride_rope_seq + dims, mask=head_dim_mask, other=0.0).to(tl.float32)
        signed_sin = sign * sin
        q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + q_partner.to(tl.float32) * signed_sin[None, :]).to(q.dtype)
    if FUSED_WRITE:
        # The new token, rounded to the cache's dtype as a separate write would store it.
        new_key_row = new_keys_ptr + seq * stride_new_key_seq + kv_head * stride_new_key_head
        new_key = tl.load(new_key_row + dims, mask=head_dim_mask)
        if ROTARY:
            key_partner = tl.load(new_key_row + partner, mask=head_dim_mask)
            new_key = new_key.to(tl.float32) * cos + key_partner.to(tl.float32) * signed_sin
        new_key = new_key.to(key_cache_ptr.dtype.element_ty)
        new_value = tl.load(
            new_values_ptr + seq * stride_new_value_seq + kv_head * stride_new_value_head + dims,
            mask=head_dim_mask,
        ).to(value_cache_ptr.dtype.element_ty)

    # Scores are kept in log2 units (scale folded with log2(e)) so that the softmax uses exp2.
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for start in range(first, end, BLOCK_TOKENS):
        tokens = start + tl.arange(0, BLOCK_TOKENS)
        token_mask = tokens < end
        blocks = tl.load(
            block_tables_ptr + seq * stride_table_seq + (tokens // block_size) * stride_table_block,
            mask=token_mask,
            other=0,
        ).to(tl.int64)
        offsets = tokens % block_size
        kv_mask = token_mask[:, None] & head_dim_mask[None, :]
        key_rows = blocks * stride_key_block + offsets * stride_key_token + kv_head * stride_key_head
        keys = tl.load(key_cache_ptr + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FUSED_WRITE:
            is_new = (tokens == context_len - 1)[:, None]
            keys = tl.where(is_new, new_key[None, :], keys)
        scores = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        value_rows = blocks * stride_value_block + offsets * stride_value_token + kv_head * stride_value_head
        values = tl.load(value_cache_ptr + value_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FUSED_WRITE:
            values = tl.where(is_new, new_value[None, :], values)
        acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
        running_max = new_max

    if FUSED_WRITE:
        # The split holding the last position (split 0 for an empty context) stores the new token, after its own
        # reads: every program took it from registers, so the store's order among programs does not matter.
        writer = tl.where(context_len > 0, (context_len - 1) // tl.maximum(share, 1), 0)
        if split == writer:
            slot = tl.load(slots_ptr + seq)
            key_slot = (slot // block_size) * stride_key_block + (slot % block_size) * stride_key_token
            value_slot = (slot // block_size) * stride_value_block + (slot % block_size) * stride_value_token
            tl.store(key_cache_ptr + key_slot + kv_head * stride_key_head + dims, new_key, mask=head_dim_mask)
            tl.store(value_cache_ptr + value_slot + kv_head * stride_value_head + dims, new_value, mask=head_dim_mask)

    if SPLITS == 1:
        # An empty context (a padding row) leaves running_sum at 0: write zeros, not 0 / 0.
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partial results [seq, kv_head, split, GROUP_PAD(, HEAD_DIM_PAD)], contiguous; an empty share writes a
        # max of -inf and a sum of 0, which the combine weighs by 0.
        pair = seq * tl.num_programs(1) + kv_head
        slot = pair * SPLITS + split
        tl.store(partial_max_ptr + slot * GROUP_PAD + group, running_max)
        tl.store(partial_sum_ptr + slot * GROUP_PAD + group, running_sum)
        tile = slot * GROUP_PAD * HEAD_DIM_PAD + group[:, None] * HEAD_DIM_PAD + dims[None, :]
        tl.store(partial_out_ptr + tile, acc)
        # The pair's last program to finish combines every split's results (``arrival_programs``).
        if LAST_COMBINES:
            if last_to_arrive(arrivals_ptr, pair, SPLITS):
                _combine(
                    out_ptr,
                    partial_out_ptr,
                    partial_max_ptr,
                    partial_sum_ptr,
                    seq,
                    kv_head,
                    pair * SPLITS,
                    stride_out_seq,
                    stride_out_head,
                    GROUP,
                    GROUP_PAD,
                    HEAD_DIM,
                    HEAD_DIM_PAD,
                    SPLITS,
                )
                reset_arrivals(arrivals_ptr, pair)


@triton.jit
def _combine(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    seq,
    kv_head,
    first_slot,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (sequence, KV head) pair's splits, from ``first_slot`` on, into its output: each split's sum and output
    weighed by ``exp2(its max - the overall max)`` (log2 units, as the scores). The partial results are read past
    the multiprocessor's L1 (``.cg``): another program wrote them. Both walks over the splits are unrolled
    (``static_range``), so each issues its independent loads together: one memory round trip each where a loop
    waited for every split's in turn (at batch 1 the combine is the end of the kernel's chain of dependent loads)."""
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    overall = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for split in tl.static_range(SPLITS):
        split_max = tl.load(partial_max_ptr + (first_slot + split) * GROUP_PAD + group, cache_modifier=".cg")
        overall = tl.maximum(overall, split_max)
    # A pair with no context at all keeps -inf everywhere: weigh by exp2(-inf - 0) = 0 and write zeros.
    safe = tl.where(overall == float("-inf"), 0.0, overall)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for split in tl.static_range(SPLITS):
        slot = first_slot + split
        weight = tl.exp2(tl.load(partial_max_ptr + slot * GROUP_PAD + group, cache_modifier=".cg") - safe)
        total += weight * tl.load(partial_sum_ptr + slot * GROUP_PAD + group, cache_modifier=".cg")
        tile = slot * GROUP_PAD * HEAD_DIM_PAD + group[:, None] * HEAD_DIM_PAD + dims[None, :]
        acc += weight[:, None] * tl.load(partial_out_ptr + tile, cache_modifier=".cg")
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    heads = kv_head * GROUP + group
    q_mask = (group < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def combine_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    """Split-K's combine as a kernel of its own (``PagedConfig.last_combines`` off): one program per pair."""
    wait_for_the_kernel_before(DEPENDENT_LAUNCH)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_slot = (seq * tl.num_programs(1) + kv_head) * SPLITS
    _combine(
        out_ptr,
        partial_out_ptr,
        partial_max_ptr,
        partial_sum_ptr,
        seq,
        kv_head,
        first_slot,
        stride_out_seq,
        stride_out_head,
        GROUP,
        GROUP_PAD,
        HEAD_DIM,
        HEAD_DIM_PAD,
        SPLITS,
    )
