"""The skinny-linear kernels measured at real widths (``gpu_kernels.py``'s ``skinny_linear``; ``gpu_skinny_sweep.py``
sweeps their tiling with the same pieces): the projections of a decoder block of the 1.5B and 7B shapes, each timed
inside CUDA graphs over 28 distinct weights (one per layer: a repeated weight would be read from L2), plain and as the
fused decode block runs it, against ``F.linear`` (cuBLAS)."""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from gpu_timing import GRAPH_CALLS, graphed_seconds

from spmd_rlhf.kernels.skinny_linear import (
    DEFAULT_CONFIG,
    SkinnyConfig,
    skinny_launch,
    skinny_linear,
    skinny_norm_linear,
    skinny_silu_mul_linear,
)
from spmd_rlhf.kernels.triton_support import multiprocessors

SKINNY_SHAPES = {
    "1.5b": {
        "qkv": (1536, 2048, True),
        "o": (1536, 1536, False),
        "gate_up": (1536, 17920, False),
        "down": (8960, 1536, False),
    },
    "7b": {
        "qkv": (3584, 4608, True),
        "o": (3584, 3584, False),
        "gate_up": (3584, 37888, False),
        "down": (18944, 3584, False),
    },
}
"""(in_features, out_features, bias) of each projection of a block of the Qwen2.5 shapes, q/k/v and gate/up merged."""


FUSED_PROLOGUES = {"qkv": "residual add and RMSNorm", "gate_up": "residual add and RMSNorm", "down": "silu * up"}
"""The elementwise work ``engine.decode_matmul`` moves into each projection's kernel at a few rows: each such
projection is also timed with it (``prologue_us``: what it adds to the plain kernel; the kernels it removes took
about 1.5 us each in session 44's H200 profile)."""


def engine_projection(
    name: str, in_features: int, rows: int, device: str, dtype: torch.dtype, config: SkinnyConfig = DEFAULT_CONFIG
):
    """``linear(x, weight, bias)`` for ``per_layer_seconds`` running projection ``name`` as a fused decode block
    does (``engine.decode_matmul``): with its prologue (``FUSED_PROLOGUES``; its other inputs made here, ``rows``
    rows), or plain (o), through the kernels tiled by ``config``."""
    if name == "down":
        gate_up = torch.randn(rows, 2 * in_features, device=device, dtype=dtype)
        return lambda x, weight, bias: skinny_silu_mul_linear(gate_up, weight, bias, config=config)
    if name not in FUSED_PROLOGUES:
        return lambda x, weight, bias: skinny_linear(x, weight, bias, config=config)
    residual = torch.randn(rows, in_features, device=device, dtype=dtype)
    norm_weight = torch.rand(in_features, device=device, dtype=dtype) + 0.5
    return lambda x, weight, bias: skinny_norm_linear(
        x, norm_weight, 1e-6, weight, bias, residual=residual, config=config
    )[1]


def projection_weights(
    in_features: int, out_features: int, has_bias: bool, args: argparse.Namespace, dtype: torch.dtype
) -> tuple[int, int, list[torch.Tensor], list[torch.Tensor | None]]:
    """``(in_features, out_features, weights, biases)``: ``GRAPH_CALLS`` distinct weights (and biases, or None) of
    one projection, each width a 64th under ``--smoke``."""
    if args.smoke:
        in_features, out_features = in_features // 64, out_features // 64
    weights = [
        torch.randn(out_features, in_features, device=args.device, dtype=dtype) * in_features**-0.5
        for _ in range(GRAPH_CALLS)
    ]
    biases = [torch.randn(out_features, device=args.device, dtype=dtype) if has_bias else None for _ in weights]
    return in_features, out_features, weights, biases


def per_layer_seconds(linear, x, weights, biases, device: str, repeats: int) -> float:
    """``graphed_seconds`` of ``linear(x, weight, bias)`` through ``weights`` in turn, one per captured call."""
    layer = itertools.cycle(range(len(weights)))

    def call():
        index = next(layer)
        return linear(x, weights[index], biases[index])

    return graphed_seconds(call, device, repeats)


def measure_skinny_linear(args: argparse.Namespace, dtype: torch.dtype, copy_bytes_per_s: float) -> dict:
    """``skinny_linear`` against ``F.linear`` per projection and row count (module docstring)."""
    results, saved_per_shape = {}, {}
    for shape, layers in SKINNY_SHAPES.items():
        saved = dict.fromkeys(args.skinny_rows, 0.0)
        for name, (in_features, out_features, has_bias) in layers.items():
            in_features, out_features, weights, biases = projection_weights(
                in_features, out_features, has_bias, args, dtype
            )
            weight_bytes = weights[0].numel() * weights[0].element_size()
            for rows in args.skinny_rows:
                x = torch.randn(rows, in_features, device=args.device, dtype=dtype)
                times = {
                    kernel: per_layer_seconds(linear, x, weights, biases, args.device, args.repeats)
                    for kernel, linear in (("torch", F.linear), ("skinny", skinny_linear))
                }
                expected = F.linear(x.double(), weights[0].double(), None if biases[0] is None else biases[0].double())
                error = ((skinny_linear(x, weights[0], biases[0]).double() - expected).norm() / expected.norm()).item()
                _, _, splits, _ = skinny_launch(
                    rows, in_features, out_features, multiprocessors(torch.device(args.device))
                )
                results[f"{shape}_{name}_rows{rows}"] = {
                    "in_features": in_features,
                    "out_features": out_features,
                    "rows": rows,
                    "splits": splits,
                    "torch_us": times["torch"] * 1e6,
                    "skinny_us": times["skinny"] * 1e6,
                    "speedup": times["torch"] / times["skinny"],
                    "torch_over_copy": weight_bytes / times["torch"] / copy_bytes_per_s,
                    "skinny_over_copy": weight_bytes / times["skinny"] / copy_bytes_per_s,
                    "relative_error": error,
                }
                saved[rows] += (times["torch"] - times["skinny"]) * GRAPH_CALLS * 1e6
                if rows == 1 and name in FUSED_PROLOGUES:
                    fused_s = per_layer_seconds(
                        engine_projection(name, in_features, rows, args.device, dtype),
                        x,
                        weights,
                        biases,
                        args.device,
                        args.repeats,
                    )
                    results[f"{shape}_{name}_rows{rows}"] |= {
                        "fused": FUSED_PROLOGUES[name],
                        "fused_us": fused_s * 1e6,
                        "prologue_us": (fused_s - times["skinny"]) * 1e6,
                    }
        saved_per_shape[shape] = {str(rows): value for rows, value in saved.items()}
    return {"projections": results, "saved_us_per_28_layer_step": saved_per_shape}
