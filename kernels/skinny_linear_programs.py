"""The Triton programs of ``skinny_linear``: a few rows times a weight (the partial products of one split of the input
features), the input optionally computed on the way in (a residual add and an RMSNorm, or SwiGLU's activation), and
the sum of the splits (by each output block's last program to finish, or a kernel of its own). The module docstring
of ``skinny_linear`` describes them; its functions check the inputs and launch them. Imported only where triton is
installed."""

from __future__ import annotations

from spmd_rlhf.kernels.arrival_programs import last_to_arrive, reset_arrivals
from spmd_rlhf.kernels.grid_dependency import wait_for_the_kernel_before
from spmd_rlhf.kernels.triton_support import tl, triton

PLAIN: tl.constexpr = tl.constexpr(0)
"""The input is ``x``."""
NORM: tl.constexpr = tl.constexpr(1)
"""The input is ``rms_norm(h)``, ``h = x`` (``+ residual``, which is stored): the norm's weight multiplies each input
feature on the way in and the row's ``1 / rms(h)`` the finished sums."""
SILU_MUL: tl.constexpr = tl.constexpr(2)
"""The input is ``silu(gate) * up`` of ``x = [gate, up]`` (each ``in_features`` wide), rounded where SwiGLU rounds."""


@triton.jit
def _tile(
    start,
    end,
    in_features,
    block,
    weight_rows,
    x_rows,
    residual_rows,
    h_rows,
    norm_ptr,
    out_mask,
    row_mask,
    dtype: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    INPUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """The tile of input features from ``start``: its weights ``[BLOCK_OUT, BLOCK_IN]`` as stored, its inputs
    ``[ROWS_PAD, BLOCK_IN]`` in float32 after the prologue (``NORM``: times the norm's weight), and their squares
    before that weight (``NORM``; zeros otherwise). Features from ``end`` on are zeros; ``h`` is stored by the first
    program of each split."""
    ins = start + tl.arange(0, BLOCK_IN)
    in_mask = ins < end
    mask = row_mask[:, None] & in_mask[None, :]
    weights = tl.load(weight_rows + ins[None, :], mask=out_mask[:, None] & in_mask[None, :], other=0.0)
    inputs = tl.load(x_rows + ins[None, :], mask=mask, other=0.0).to(tl.float32)
    if INPUT == SILU_MUL:
        up = tl.load(x_rows + in_features + ins[None, :], mask=mask, other=0.0).to(tl.float32)
        activated = (inputs * tl.sigmoid(inputs)).to(dtype).to(tl.float32)
        inputs = (activated * up).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_rows + ins[None, :], mask=mask, other=0.0)
        inputs = (inputs + residual.to(tl.float32)).to(dtype)
        if block == 0:  # one program per split stores h, each split's share of the row
            tl.store(h_rows + ins[None, :], inputs, mask=mask)
        inputs = inputs.to(tl.float32)
    squares = tl.zeros([ROWS_PAD, BLOCK_IN], tl.float32)
    if INPUT == NORM:
        squares = inputs * inputs
        inputs *= tl.load(norm_ptr + ins, mask=in_mask, other=0.0).to(tl.float32)[None, :]
    return weights, inputs, squares


@triton.jit
def skinny_linear_kernel(
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    x_ptr,
    residual_ptr,
    h_ptr,
    norm_ptr,
    weight_ptr,
    bias_ptr,
    rows,
    in_features,
    out_features,
    chunk,
    stride_x_row,
    stride_residual_row,
    stride_h_row,
    stride_weight_out,
    stride_out_row,
    eps,
    ROWS_PAD: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PREFETCH: tl.constexpr,
    LAST_SUMS: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    wait_for_the_kernel_before(DEPENDENT_LAUNCH)
    block = tl.program_id(0)
    split = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    outs = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = outs < out_features
    row = tl.arange(0, ROWS_PAD)
    row_mask = row < rows
    first = split * chunk
    end = tl.minimum(in_features, first + chunk)
    weight_rows = weight_ptr + outs.to(tl.int64)[:, None] * stride_weight_out
    x_rows = x_ptr + row[:, None] * stride_x_row
    residual_rows = residual_ptr + row[:, None] * stride_residual_row
    h_rows = h_ptr + row[:, None] * stride_h_row
    # Products accumulate elementwise, [ROWS_PAD, BLOCK_OUT, BLOCK_IN] in float32 (ROWS_PAD * BLOCK_IN is fixed, so
    # as many registers at any row count), and are summed over the inputs once after the walk: a sum per tile would
    # put a cross-thread reduction, with its barriers, between one tile's loads and the next's.
    products = tl.zeros([ROWS_PAD, BLOCK_OUT, BLOCK_IN], tl.float32)
    squares = tl.zeros([ROWS_PAD, BLOCK_IN], tl.float32)
    if PREFETCH:
        # The next tile's loads are issued before this tile's products, which wait only on loads issued a tile ago:
        # one tile's latency overlapped with the next (the last iteration's are all masked: no memory read).
        weights, inputs, tile_squares = _tile(
            first, end, in_features, block, weight_rows, x_rows, residual_rows, h_rows, norm_ptr, out_mask, row_mask,
            dtype, ROWS_PAD, BLOCK_IN, INPUT, HAS_RESIDUAL
        )  # fmt: skip
        for start in range(first, end, BLOCK_IN):
            next_weights, next_inputs, next_squares = _tile(
                start + BLOCK_IN, end, in_features, block, weight_rows, x_rows, residual_rows, h_rows, norm_ptr,
                out_mask, row_mask, dtype, ROWS_PAD, BLOCK_IN, INPUT, HAS_RESIDUAL
            )  # fmt: skip
            products += inputs[:, None, :] * weights.to(tl.float32)[None, :, :]
            squares += tile_squares
            weights, inputs, tile_squares = next_weights, next_inputs, next_squares
    else:
        for start in range(first, end, BLOCK_IN):
            weights, inputs, tile_squares = _tile(
                start, end, in_features, block, weight_rows, x_rows, residual_rows, h_rows, norm_ptr, out_mask,
                row_mask, dtype, ROWS_PAD, BLOCK_IN, INPUT, HAS_RESIDUAL
            )  # fmt: skip
            products += inputs[:, None, :] * weights.to(tl.float32)[None, :, :]
            squares += tile_squares
    acc = tl.sum(products, axis=2)
    if SPLITS == 1:
        if INPUT == NORM:  # the program walked the whole row
            acc *= tl.rsqrt(tl.sum(squares, axis=1) / in_features + eps)[:, None]
        _store_output(out_ptr, bias_ptr, acc, outs, out_mask, row, row_mask, stride_out_row, HAS_BIAS)
    else:
        # This split's partial products, float32 [SPLITS, ROWS_PAD, out_features] (padding rows hold zeros).
        partial_offsets = (split * ROWS_PAD + row[:, None]) * out_features + outs[None, :]
        tl.store(partial_ptr + partial_offsets, acc, mask=out_mask[None, :])
        # The output block's last program to finish sums every split's products (``arrival_programs``).
        if LAST_SUMS:
            if last_to_arrive(arrivals_ptr, block, SPLITS):
                acc = _split_sum(partial_ptr, outs, out_mask, row, out_features, ROWS_PAD, BLOCK_OUT, SPLITS)
                _store_output(out_ptr, bias_ptr, acc, outs, out_mask, row, row_mask, stride_out_row, HAS_BIAS)
                reset_arrivals(arrivals_ptr, block)


@triton.jit
def _split_sum(partial_ptr, outs, out_mask, row, out_features, ROWS_PAD: tl.constexpr, BLOCK_OUT: tl.constexpr,
               SPLITS: tl.constexpr):  # fmt: skip
    """The splits' partial products of ``outs`` summed in float32, read past L1 (``.cg``: other programs, perhaps
    on other multiprocessors, wrote them)."""
    acc = tl.zeros([ROWS_PAD, BLOCK_OUT], tl.float32)
    for split in tl.static_range(SPLITS):
        partial_offsets = (split * ROWS_PAD + row[:, None]) * out_features + outs[None, :]
        acc += tl.load(partial_ptr + partial_offsets, mask=out_mask[None, :], other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _store_output(out_ptr, bias_ptr, acc, outs, out_mask, row, row_mask, stride_out_row, HAS_BIAS: tl.constexpr):
    """``acc`` (float32 ``[ROWS_PAD, BLOCK_OUT]``) plus the bias, rounded once to the output's dtype and stored."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=out_mask, other=0.0).to(tl.float32)[None, :]
    out_offsets = row[:, None] * stride_out_row + outs[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


@triton.jit
def sum_splits_kernel(
    out_ptr,
    partial_ptr,
    bias_ptr,
    normed_ptr,
    rows,
    in_features,
    out_features,
    stride_normed_row,
    stride_out_row,
    eps,
    ROWS_PAD: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMED: tl.constexpr,
    BLOCK_NORM: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    """The splits' partial products summed in float32 (``NORMED``: times ``1 / rms`` of ``normed_ptr``'s rows, the
    ``h`` the splits normalised), the bias added, rounded once to the output's dtype."""
    wait_for_the_kernel_before(DEPENDENT_LAUNCH)
    outs = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = outs < out_features
    row = tl.arange(0, ROWS_PAD)
    row_mask = row < rows
    acc = _split_sum(partial_ptr, outs, out_mask, row, out_features, ROWS_PAD, BLOCK_OUT, SPLITS)
    if NORMED:
        squares = tl.zeros([ROWS_PAD, BLOCK_NORM], tl.float32)
        for start in range(0, in_features, BLOCK_NORM):
            ins = start + tl.arange(0, BLOCK_NORM)
            mask = row_mask[:, None] & (ins < in_features)[None, :]
            h = tl.load(normed_ptr + row[:, None] * stride_normed_row + ins[None, :], mask=mask, other=0.0)
            squares += h.to(tl.float32) * h.to(tl.float32)
        acc *= tl.rsqrt(tl.sum(squares, axis=1) / in_features + eps)[:, None]
    _store_output(out_ptr, bias_ptr, acc, outs, out_mask, row, row_mask, stride_out_row, HAS_BIAS)
