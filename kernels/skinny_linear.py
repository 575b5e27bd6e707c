"""A linear layer for a few rows (batch-1 to batch-4 decode), spread over every multiprocessor, optionally with the
elementwise work before it (a residual add and an RMSNorm, or SwiGLU's activation) done as it reads its input.

At batch 1 a decode step's matmuls are matrix-vector products, and cuBLAS runs the small ones well below the memory
bandwidth they need: on an H200 (session 44, the 1.5B shape) q/k/v's 6.3 MB in 5.4 us and o's 4.7 MB in 6.3 us
(1.2 and 0.75 TB/s, where a large copy runs at 4.25), down's 27.5 MB in 10.0 us plus a split-K reduction of 1.6 us.
Such a product is latency: each program's chain of loads, and how many loads the whole GPU keeps in flight. The
same profile spent 4.7 us per layer in three more kernels (each residual add with the norm after it, and the MLP's
activation) over a few KB each: launches, not bytes.

``skinny_linear_kernel``: each program computes ``BLOCK_OUT`` outputs for every row (the rows padded to a power of
two, ``ROWS_PAD``), walking its share of the input features in tiles of ``BLOCK_IN``, in float32. Outputs are split
finely (8 per program: hundreds of programs for a 1,536-wide layer, every multiprocessor holding several), and a wide
input is split too (``SPLITS`` programs per output block, each writing float32 partial products that the block's
last program to finish adds up with the bias, or ``sum_splits_kernel`` where the input is normalised:
``SkinnyConfig.last_sums``), so that no program walks more than a few tiles (``skinny_launch``).
Each weight element is read once whatever the row count; the rows' inputs are reread by every program (a few KB,
from cache), which is what lets each program compute them itself:

- ``skinny_norm_linear``: ``linear(rms_norm(h))`` with ``h = x + residual`` (rounded to the dtype, as the model
  adds; the first program of each split stores its share of ``h``, the block's new residual stream). The norm's
  weight multiplies each input feature as it is read and ``1 / rms(h)``, one number per row, the finished sums: the
  program that walks the whole row adds up its squares on the way, and with a split input ``sum_splits_kernel``
  reads the row again (a few KB). The normalised input is not rounded to the dtype before the product, as the
  model's norm rounds it: the float32 value is used, a difference within the dtype's rounding.
- ``skinny_silu_mul_linear``: ``linear(silu(gate) * up)`` of ``[gate, up]`` (the merged gate/up matmul's output),
  rounded where SwiGLU rounds.

Each function takes up to its tiling's ``max_rows`` rows (at most ``MAX_ROWS``) through the kernels and anything
else through its torch reference (``F.linear`` after the model's own ``rms_norm`` / ``silu``), so a layer can call
it for every batch; each has an operator (``torch.ops.spmd_rlhf.skinny_linear`` and the others, registered by
``kernels.skinny_operators``) that a compiled decoder block calls as one opaque kernel call and a CUDA graph
captures. Forward only: the generation copy's weights take no gradient. Whether they beat cuBLAS and Inductor is for
a GPU to say (``benchmarks/gpu_kernels.py``'s ``skinny_linear``); ``rollout.decode_matmul`` turns them on
(``engine.decode_matmul``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from spmd_rlhf.kernels.triton_support import (
    arrival_counts,
    dependent_launch_option,
    launch_device,
    multiprocessors,
    triton,
    use_triton,
)
from spmd_rlhf.models.decoder import rms_norm

if triton is not None:
    from spmd_rlhf.kernels.skinny_linear_programs import (
        NORM,
        PLAIN,
        SILU_MUL,
        skinny_linear_kernel,
        sum_splits_kernel,
    )

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_ROWS = 4
"""Most rows the kernels take; more go through ``F.linear`` (from 8 rows on, a GEMM's tiles use the tensor cores)."""

MAX_SPLITS = 16
"""Most programs one output block is split over (``sum_splits_kernel`` reads every split's partial products)."""

SUM_BLOCK = 256
"""Outputs per program of ``sum_splits_kernel``, and the row features it reads per step to normalise."""


@dataclass(frozen=True)
class SkinnyConfig:
    """How the kernels tile a product: the defaults are reasoned, not measured; ``benchmarks/gpu_skinny_sweep.py``
    times alternatives on a GPU."""

    block_out: int = 8
    """Outputs per program: few, so that even a 1,536-wide layer is hundreds of programs."""
    tile_elements: int = 512
    """Rows x input features per tile (``rows_pad * block_in``): the float32 products a program holds at once are
    ``block_out`` times as many, and each thread loads ``block_out * tile_elements / (32 * num_warps)`` weights
    per tile (16 bytes of bf16 at the defaults, four times)."""
    tiles_per_split: int = 3
    """Tiles one program walks at most before the input is split: each is a dependent load, about a microsecond."""
    programs_per_processor: int = 8
    """Splitting the input stops once the launch has this many programs per multiprocessor."""
    num_warps: int = 4
    """Warps per program of the product kernel."""
    last_sums: bool = True
    """A split input's partial products summed by each output block's last program to finish (an arrival count per
    block), not by ``sum_splits_kernel``: one launch per product fewer (on an H200, session 47, that kernel was
    1.0 us of each layer's batch-1 step, its launch besides). Not where the input is normalised (``NORM``): its
    ``1 / rms`` needs the whole row, which other output blocks' programs write."""
    max_rows: int = MAX_ROWS
    """Most rows (1 to ``MAX_ROWS``) the kernels take; more go through the torch reference. On an H200 (session 47,
    the 1.5B shape) the kernels beat cuBLAS at one row and lost at two and four (q/k/v 7.6 and 10.9 us against 6.2,
    gate/up 22.4 and 34.5 against 16.7): the engine's tilings take one (``engine.decode_matmul.DEFAULT_TILINGS``)."""
    prefetch: bool = False
    """Issue each tile's loads a tile ahead (registers hold two tiles), so that a program's walk waits on memory once
    instead of once per tile."""
    dependent_launch: bool = False
    """Launch the kernels with programmatic dependent launch (``kernels.grid_dependency``; CUDA on Hopper and later,
    not under the interpreter): each may start while the kernel before it finishes, its programs waiting for it
    before they touch memory. Untimed (session 48); ``gpu_skinny_sweep.py`` times it."""

    def as_tiling(self) -> list[int]:
        """The fields as the operators take them (``torch.ops.spmd_rlhf.skinny_linear``'s ``tiling``)."""
        return [int(getattr(self, field.name)) for field in fields(self)]

    def __post_init__(self) -> None:
        for name in ("block_out", "tile_elements"):
            value = getattr(self, name)
            if value < MAX_ROWS or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name}={value} must be a power of two of at least {MAX_ROWS}")
        if self.tiles_per_split < 1 or self.programs_per_processor < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{self}: tiles_per_split and programs_per_processor >= 1, num_warps a power of two")
        if not 1 <= self.max_rows <= MAX_ROWS:
            raise ValueError(f"SkinnyConfig.max_rows={self.max_rows} must be 1 to {MAX_ROWS}")


DEFAULT_CONFIG = SkinnyConfig()


def config_of(tiling: list[int]) -> SkinnyConfig:
    """The ``SkinnyConfig`` of an operator's ``tiling`` (``SkinnyConfig.as_tiling``): built and validated once per
    tiling, not at every call of every layer of an eager decode step."""
    return _config_of(tuple(tiling))


@functools.cache
def _config_of(tiling: tuple[int, ...]) -> SkinnyConfig:
    values = dict(zip((field.name for field in fields(SkinnyConfig)), tiling, strict=True))
    return SkinnyConfig(**values | {name: bool(values[name]) for name in ("last_sums", "prefetch", "dependent_launch")})


@functools.cache
def skinny_launch(
    rows: int, in_features: int, out_features: int, processors: int, config: SkinnyConfig = DEFAULT_CONFIG
) -> tuple[int, int, int, int]:
    """``(rows_pad, block_in, splits, chunk)`` for a product of ``rows`` rows: the rows padded to a power of two, the
    tile's input width, the programs per output block and the input features each walks (a multiple of
    ``block_in``; ``splits * chunk >= in_features``, and the last split is never empty). Cached: every layer of every
    eager decode step asks it for the same few shapes."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny_launch takes 1 to {MAX_ROWS} rows, got {rows}")
    rows_pad = 1 << (rows - 1).bit_length()
    block_in = config.tile_elements // rows_pad
    tiles = -(-in_features // block_in)
    blocks = -(-out_features // config.block_out)
    wanted = min(-(-tiles // config.tiles_per_split), MAX_SPLITS)
    room = max(1, config.programs_per_processor * processors // blocks)
    splits = max(1, min(wanted, room))
    chunk = -(-tiles // splits) * block_in
    splits = -(-in_features // chunk)  # rounding the chunk up to whole tiles can leave the last split empty: drop it
    return rows_pad, block_in, splits, chunk


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, x_width: int) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != x_width:
        raise ValueError(
            f"takes x [..., {x_width}] for a weight [out_features, in_features] = {list(weight.shape)}, got x "
            f"{list(x.shape)} (in_features mismatch)"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [out_features={weight.shape[0]}], got {list(bias.shape)}")


def _kernels_take(
    rows: int, config: SkinnyConfig, backend: str, weight: torch.Tensor, *tensors: torch.Tensor | None
) -> bool:
    """Whether the kernels run this product: at most ``config.max_rows`` rows, one supported dtype and device for all,
    a weight contiguous in its inputs and vectors (a bias, a norm's weight) contiguous, and ``backend`` picking
    Triton; anything else is the torch reference's (which also raises what it raises for mismatched inputs). Rows
    of any layout are taken (``_row_major`` copies them where needed)."""
    given = [t for t in (weight, *tensors) if t is not None]
    return (
        1 <= rows <= config.max_rows
        and weight.dtype in SUPPORTED_DTYPES
        and all(t.dtype == weight.dtype and t.device == weight.device for t in given)
        and weight.stride(-1) == 1
        and all(t.stride(-1) == 1 for t in given if t.dim() == 1)
        and use_triton(weight.device, backend)
    )


def _row_major(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` as ``[rows, features]``, each row contiguous."""
    x_rows = x.reshape(rows, x.shape[-1])
    return x_rows if x_rows.stride(-1) == 1 else x_rows.contiguous()


def _launch(
    x_rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    input_kind: int,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    splits: int | None = None,
    config: SkinnyConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [rows, out_features], h [rows, in_features] or None)``: the kernels' product of ``x_rows`` (row-major
    ``[rows, in_features]``, ``[rows, 2 * in_features]`` for ``SILU_MUL``), ``h`` where a residual is added."""
    rows = x_rows.shape[0]
    out_features, in_features = weight.shape
    processors = multiprocessors(x_rows.device)
    rows_pad, block_in, chosen, chunk = skinny_launch(rows, in_features, out_features, processors, config)
    if splits is not None:
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits={splits} must be 1 to {MAX_SPLITS}")
        chunk = -(-in_features // (splits * block_in)) * block_in
        chosen = -(-in_features // chunk)
    out = torch.empty((rows, out_features), dtype=x_rows.dtype, device=x_rows.device)
    h = torch.empty_like(x_rows) if residual is not None else None
    partial = torch.empty(
        (chosen, rows_pad, out_features) if chosen > 1 else (1,), dtype=torch.float32, device=x_rows.device
    )
    blocks = -(-out_features // config.block_out)
    last_sums = chosen > 1 and config.last_sums and input_kind != NORM.value
    arrivals = arrival_counts(x_rows.device, blocks) if last_sums else partial  # else never read
    # Pointers a launch does not read (no bias, no residual, no norm) are x's, never dereferenced.
    unused = x_rows
    normed = h if h is not None else x_rows
    with launch_device(x_rows.device):
        skinny_linear_kernel[(blocks, chosen)](
            out,
            partial,
            arrivals,
            x_rows,
            residual if residual is not None else unused,
            normed,
            norm_weight if norm_weight is not None else unused,
            weight,
            bias if bias is not None else unused,
            rows,
            in_features,
            out_features,
            chunk,
            x_rows.stride(0),
            residual.stride(0) if residual is not None else 0,
            normed.stride(0),
            weight.stride(0),
            out.stride(0),
            eps,
            ROWS_PAD=rows_pad,
            BLOCK_OUT=config.block_out,
            BLOCK_IN=block_in,
            SPLITS=chosen,
            HAS_BIAS=bias is not None,
            INPUT=input_kind,
            HAS_RESIDUAL=residual is not None,
            PREFETCH=config.prefetch,
            LAST_SUMS=last_sums,
            DEPENDENT_LAUNCH=config.dependent_launch,
            num_warps=config.num_warps,
            **dependent_launch_option(config.dependent_launch),
        )
        if chosen > 1 and not last_sums:
            sum_splits_kernel[(-(-out_features // SUM_BLOCK),)](
                out,
                partial,
                bias if bias is not None else unused,
                normed,
                rows,
                in_features,
                out_features,
                normed.stride(0),
                out.stride(0),
                eps,
                ROWS_PAD=rows_pad,
                BLOCK_OUT=SUM_BLOCK,
                SPLITS=chosen,
                HAS_BIAS=bias is not None,
                NORMED=input_kind == NORM.value,
                BLOCK_NORM=SUM_BLOCK,
                DEPENDENT_LAUNCH=config.dependent_launch,
                **dependent_launch_option(config.dependent_launch),
            )
    return out, h


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    splits: int | None = None,
    config: SkinnyConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the Triton kernels when ``x`` has at most ``config.max_rows`` rows (its
    leading dimensions flattened), every tensor one float16 / bfloat16 / float32 dtype, and ``backend`` picks Triton
    (``auto``: CUDA tensors with triton installed; ``triton``; ``torch``: always ``F.linear``), in float32 rounded
    once to ``x``'s dtype; otherwise ``F.linear`` itself. ``splits``: programs per output block (None:
    ``skinny_launch``'s choice for this device); ``config``: the tiling (``SkinnyConfig``)."""
    _check_inputs(x, weight, bias, x_width=weight.shape[-1])
    rows = _rows(x)
    if not _kernels_take(rows, config, backend, weight, x, bias):
        return F.linear(x, weight, bias)
    out, _ = _launch(_row_major(x, rows), weight, bias, input_kind=PLAIN.value, splits=splits, config=config)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def skinny_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    backend: str = "auto",
    splits: int | None = None,
    config: SkinnyConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, F.linear(rms_norm(h, norm_weight, eps), weight, bias))`` with ``h = x + residual`` (``x`` itself where
    ``residual`` is None): through the kernels under ``skinny_linear``'s conditions (``residual`` and
    ``norm_weight`` of ``x``'s dtype and device), else the torch reference."""
    _check_inputs(x, weight, bias, x_width=weight.shape[-1])
    if tuple(norm_weight.shape) != (x.shape[-1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"norm_weight must be [{x.shape[-1]}] and residual x's shape {list(x.shape)}, got "
            f"{list(norm_weight.shape)} and {None if residual is None else list(residual.shape)}"
        )
    rows = _rows(x)
    if not _kernels_take(rows, config, backend, weight, x, bias, residual, norm_weight):
        h = x if residual is None else x + residual
        return h, F.linear(rms_norm(h, norm_weight, eps), weight, bias)
    out, h = _launch(
        _row_major(x, rows),
        weight,
        bias,
        input_kind=NORM.value,
        residual=None if residual is None else _row_major(residual, rows),
        norm_weight=norm_weight,
        eps=eps,
        splits=splits,
        config=config,
    )
    return x if h is None else h.view(x.shape), out.reshape(*x.shape[:-1], weight.shape[0])


def skinny_silu_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    splits: int | None = None,
    config: SkinnyConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight, bias)`` of ``gate_up = [gate, up]`` (``[..., 2 * in_features]``):
    through the kernels under ``skinny_linear``'s conditions, else that torch reference."""
    _check_inputs(gate_up, weight, bias, x_width=2 * weight.shape[-1])
    rows = _rows(gate_up)
    if not _kernels_take(rows, config, backend, weight, gate_up, bias):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, weight, bias)
    out, _ = _launch(_row_major(gate_up, rows), weight, bias, input_kind=SILU_MUL.value, splits=splits, config=config)
    return out.reshape(*gate_up.shape[:-1], weight.shape[0])
