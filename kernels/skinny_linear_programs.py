"""The Triton programs of ``skinny_linear``: a few rows times a weight (the partial products of one split of the input
features) and the sum of the splits. The module docstring of ``skinny_linear`` describes them; its ``skinny_linear``
checks the inputs and launches them. Imported only where triton is installed."""

from __future__ import annotations

from spmd_rlhf.kernels.triton_support import tl, triton


@triton.jit
def skinny_linear_kernel(
    out_ptr,
    partial_ptr,
    x_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    in_features,
    out_features,
    chunk,
    stride_x_row,
    stride_weight_out,
    stride_out_row,
    ROWS_PAD: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    outs = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = outs < out_features
    row = tl.arange(0, ROWS_PAD)
    row_mask = row < rows
    first = split * chunk
    end = tl.minimum(in_features, first + chunk)
    weight_rows = weight_ptr + outs.to(tl.int64)[:, None] * stride_weight_out
    x_rows = x_ptr + row[:, None] * stride_x_row
    # Products accumulate elementwise, [ROWS_PAD, BLOCK_OUT, BLOCK_IN] in float32 (ROWS_PAD * BLOCK_IN is fixed, so
    # as many registers at any row count), and are summed over the inputs once after the walk: a sum per tile would
    # put a cross-thread reduction, with its barriers, between one tile's loads and the next's.
    products = tl.zeros([ROWS_PAD, BLOCK_OUT, BLOCK_IN], tl.float32)
    for start in range(first, end, BLOCK_IN):
        ins = start + tl.arange(0, BLOCK_IN)
        in_mask = ins < end
        weights = tl.load(weight_rows + ins[None, :], mask=out_mask[:, None] & in_mask[None, :], other=0.0)
        inputs = tl.load(x_rows + ins[None, :], mask=row_mask[:, None] & in_mask[None, :], other=0.0)
        products += inputs.to(tl.float32)[:, None, :] * weights.to(tl.float32)[None, :, :]
    acc = tl.sum(products, axis=2)
    if SPLITS == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
        out_offsets = row[:, None] * stride_out_row + outs[None, :]
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])
    else:
        # This split's partial products, float32 [SPLITS, ROWS_PAD, out_features] (padding rows hold zeros).
        partial_offsets = (split * ROWS_PAD + row[:, None]) * out_features + outs[None, :]
        tl.store(partial_ptr + partial_offsets, acc, mask=out_mask[None, :])


@triton.jit
def sum_splits_kernel(
    out_ptr,
    partial_ptr,
    bias_ptr,
    rows,
    out_features,
    stride_out_row,
    ROWS_PAD: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The splits' partial products summed (and the bias added) in float32, rounded once to the output's dtype."""
    outs = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = outs < out_features
    row = tl.arange(0, ROWS_PAD)
    acc = tl.zeros([ROWS_PAD, BLOCK_OUT], tl.float32)
    for split in tl.static_range(SPLITS):
        partial_offsets = (split * ROWS_PAD + row[:, None]) * out_features + outs[None, :]
        acc += tl.load(partial_ptr + partial_offsets, mask=out_mask[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
    out_offsets = row[:, None] * stride_out_row + outs[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=(row < rows)[:, None] & out_mask[None, :])
