"""A linear layer for a few rows (batch-1 to batch-4 decode), spread over every multiprocessor.

At batch 1 a decode step's matmuls are matrix-vector products, and cuBLAS runs the small ones well below the memory
bandwidth they need: on an H200 (session 44, the 1.5B shape) q/k/v's 6.3 MB in 5.4 us and o's 4.7 MB in 6.3 us
(1.2 and 0.75 TB/s, where a large copy runs at 4.25), down's 27.5 MB in 10.0 us plus a split-K reduction of 1.6 us.
Such a product is latency: each program's chain of loads, and how many loads the whole GPU keeps in flight.

``skinny_linear_kernel``: each program computes ``BLOCK_OUT`` outputs for every row (the rows padded to a power of
two, ``ROWS_PAD``), walking its share of the input features in tiles of ``BLOCK_IN``, in float32. Outputs are split
finely (8 per program: hundreds of programs for a 1,536-wide layer, every multiprocessor holding several), and a wide
input is split too (``SPLITS`` programs per output block, each writing float32 partial products that
``sum_splits_kernel`` adds up with the bias), so that no program walks more than a few tiles (``skinny_launch``).
Each weight element is read once whatever the row count; the rows' inputs are reread by every program (a few KB,
from cache).

``skinny_linear`` takes up to ``MAX_ROWS`` rows through the kernels and anything else through ``F.linear``, so a
layer can call it for every batch; ``skinny_linear_op`` is the same as a custom operator
(``torch.ops.spmd_rlhf.skinny_linear``), which a compiled decoder block calls as one opaque kernel call and a CUDA
graph captures. Forward only: the generation copy's weights take no gradient. Whether it beats cuBLAS is for a GPU
to say (``benchmarks/gpu_kernels.py``'s ``skinny_linear``); ``rollout.decode_matmul=triton`` turns it on.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from spmd_rlhf.kernels.triton_support import launch_device, multiprocessors, triton, use_triton

if triton is not None:
    from spmd_rlhf.kernels.skinny_linear_programs import skinny_linear_kernel, sum_splits_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_ROWS = 4
"""Most rows the kernels take; more go through ``F.linear`` (from 8 rows on, a GEMM's tiles use the tensor cores)."""

BLOCK_OUT = 8
"""Outputs per program: few, so that even a 1,536-wide layer is hundreds of programs."""

TILE_ELEMENTS = 512
"""Rows x input features per tile (``ROWS_PAD * BLOCK_IN``): the float32 products a program holds at once."""

TILES_PER_SPLIT = 3
"""Tiles one program walks at most before the input is split: each is a dependent load, about a microsecond."""

MAX_SPLITS = 16
"""Most programs one output block is split over (``sum_splits_kernel`` reads every split's partial products)."""

PROGRAMS_PER_PROCESSOR = 8
"""Splitting the input stops once the launch has this many programs per multiprocessor."""


@functools.cache
def skinny_launch(rows: int, in_features: int, out_features: int, processors: int) -> tuple[int, int, int, int]:
    """``(rows_pad, block_in, splits, chunk)`` for a product of ``rows`` rows: the rows padded to a power of two, the
    tile's input width, the programs per output block and the input features each walks (a multiple of
    ``block_in``; ``splits * chunk >= in_features``, and the last split is never empty). Cached: every layer of every
    eager decode step asks it for the same few shapes."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny_launch takes 1 to {MAX_ROWS} rows, got {rows}")
    rows_pad = 1 << (rows - 1).bit_length()
    block_in = TILE_ELEMENTS // rows_pad
    tiles = -(-in_features // block_in)
    blocks = -(-out_features // BLOCK_OUT)
    wanted = min(-(-tiles // TILES_PER_SPLIT), MAX_SPLITS)
    room = max(1, PROGRAMS_PER_PROCESSOR * processors // blocks)
    splits = max(1, min(wanted, room))
    chunk = -(-tiles // splits) * block_in
    splits = -(-in_features // chunk)  # rounding the chunk up to whole tiles can leave the last split empty: drop it
    return rows_pad, block_in, splits, chunk


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear takes x [..., in_features] and weight [out_features, in_features], got x "
            f"{list(x.shape)} and weight {list(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [out_features={weight.shape[0]}], got {list(bias.shape)}")


def _kernels_take(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, backend: str) -> bool:
    """Whether the kernels run this product: at most ``MAX_ROWS`` rows, one supported dtype and device for all,
    a weight contiguous in its inputs, and ``backend`` picking Triton; anything else is ``F.linear``'s (which also
    raises what it raises for mismatched inputs)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        1 <= rows <= MAX_ROWS
        and x.dtype in SUPPORTED_DTYPES
        and all(t.dtype == x.dtype and t.device == x.device for t in tensors)
        and weight.stride(-1) == 1
        and use_triton(x.device, backend)
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    splits: int | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the Triton kernels when ``x`` has at most ``MAX_ROWS`` rows (its
    leading dimensions flattened), every tensor one float16 / bfloat16 / float32 dtype, and ``backend`` picks Triton
    (``auto``: CUDA tensors with triton installed; ``triton``; ``torch``: always ``F.linear``), in float32 rounded
    once to ``x``'s dtype; otherwise ``F.linear`` itself. ``splits``: programs per
    output block (None: ``skinny_launch``'s choice for this device)."""
    _check_inputs(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not _kernels_take(x, weight, bias, rows, backend):
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    x_rows = x.reshape(rows, in_features)
    if x_rows.stride(-1) != 1:
        x_rows = x_rows.contiguous()
    rows_pad, block_in, chosen, chunk = skinny_launch(rows, in_features, out_features, multiprocessors(x.device))
    if splits is not None:
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits={splits} must be 1 to {MAX_SPLITS}")
        chunk = -(-in_features // (splits * block_in)) * block_in
        chosen = -(-in_features // chunk)
    out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    partial = torch.empty(
        (chosen, rows_pad, out_features) if chosen > 1 else (1,), dtype=torch.float32, device=x.device
    )
    bias_or_x = bias if bias is not None else x_rows  # never read without HAS_BIAS
    with launch_device(x.device):
        skinny_linear_kernel[(-(-out_features // BLOCK_OUT), chosen)](
            out,
            partial,
            x_rows,
            weight,
            bias_or_x,
            rows,
            in_features,
            out_features,
            chunk,
            x_rows.stride(0),
            weight.stride(0),
            out.stride(0),
            ROWS_PAD=rows_pad,
            BLOCK_OUT=BLOCK_OUT,
            BLOCK_IN=block_in,
            SPLITS=chosen,
            HAS_BIAS=bias is not None,
        )
        if chosen > 1:
            sum_block = 256
            sum_splits_kernel[(-(-out_features // sum_block),)](
                out,
                partial,
                bias_or_x,
                rows,
                out_features,
                out.stride(0),
                ROWS_PAD=rows_pad,
                BLOCK_OUT=sum_block,
                SPLITS=chosen,
                HAS_BIAS=bias is not None,
            )
    return out.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("spmd_rlhf::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    """``skinny_linear`` as an operator that TorchDynamo and Inductor leave opaque."""
    return skinny_linear(x, weight, bias, backend=backend)


@skinny_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
