"""The skinny-linear kernels' tiling (``kernels.skinny_linear.SkinnyConfig``) swept on one GPU, so that one GPU slot
says which tiling decode should use:

    python benchmarks/gpu_skinny_sweep.py [--rows 1] [--repeats 5]    # on a GPU: about a minute
    python benchmarks/gpu_skinny_sweep.py --smoke                     # CPU-sized: checks the script in seconds

For each config of ``SWEEP`` (the default, then one field changed at a time, then a few pairs and prefetching),
every projection of one block of the 1.5B and 7B shapes (``gpu_skinny.SKINNY_SHAPES``: q/k/v and gate/up merged, o,
down) at ``--rows`` rows, bf16, as a fused decode block runs it (``gpu_skinny.engine_projection``: q/k/v and gate/up
with the residual add and RMSNorm before them, down with SwiGLU's activation, o plain), timed inside CUDA graphs over
28 distinct weights as ``gpu_kernels`` times them, with ``F.linear`` (cuBLAS, no prologue: the kernels the fusion
removes are not counted for it) in the same run; each config's plain product checked against float64. Per shape:
each config's block (the four projections' sum), the best config, and the microseconds a 28-layer step saves with
it over the default and over cuBLAS. A config whose kernels fail to compile or run is reported with its error, not
dropped. The suite's ``g1_skinny``, run after it, decodes with the best (``gpu_generate.py --skinny-config``).

On CPU (or with ``--smoke``) both sides run ``F.linear``: the figures check the script, not the kernels. Writes
``benchmarks/results/gpu_skinny_sweep_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
from gpu_common import add_kernel_arguments, environment, kernel_dtype, parse_with_smoke, write_result
from gpu_skinny import SKINNY_SHAPES, engine_projection, per_layer_seconds, projection_weights
from gpu_timing import GRAPH_CALLS

from spmd_rlhf.kernels.skinny_linear import DEFAULT_CONFIG, skinny_launch, skinny_linear
from spmd_rlhf.kernels.triton_support import multiprocessors

SWEEP = (
    DEFAULT_CONFIG,
    replace(DEFAULT_CONFIG, block_out=4),
    replace(DEFAULT_CONFIG, block_out=16),
    replace(DEFAULT_CONFIG, tile_elements=256),
    replace(DEFAULT_CONFIG, tile_elements=1024),
    replace(DEFAULT_CONFIG, num_warps=2),
    replace(DEFAULT_CONFIG, num_warps=8),
    replace(DEFAULT_CONFIG, tiles_per_split=1),
    replace(DEFAULT_CONFIG, tiles_per_split=6),
    replace(DEFAULT_CONFIG, programs_per_processor=4),
    replace(DEFAULT_CONFIG, programs_per_processor=16),
    replace(DEFAULT_CONFIG, tile_elements=1024, num_warps=8),
    replace(DEFAULT_CONFIG, block_out=16, num_warps=8),
    replace(DEFAULT_CONFIG, block_out=4, tiles_per_split=1),
    replace(DEFAULT_CONFIG, prefetch=True),
    replace(DEFAULT_CONFIG, prefetch=True, tiles_per_split=6),
    replace(DEFAULT_CONFIG, prefetch=True, tile_elements=256),
    replace(DEFAULT_CONFIG, num_warps=2, last_sums=False),
    replace(DEFAULT_CONFIG, num_warps=2, dependent_launch=True),
)
"""The default, each field moved once either way, pairs that keep a thread's loads per tile as they are (wider
tiles or more outputs with more warps) or trade outputs per program for splits, the next tile's loads issued a
tile ahead (``prefetch``), alone, with longer walks (fewer splits: the latency it hides is per tile) and with smaller
tiles (two of them in registers), and the engine's down tiling (two warps, the fifth) with its split sum in a kernel
of its own (session 46's way: against the fifth, what the last program's sum saves), and the fifth launched with
programmatic dependent launch (each call may start while the one before it ends: against the fifth, what that
saves a call)."""

ERROR_BOUND = 1.6e-2
"""bf16's bound on the relative error against float64 (``tests/kernels/kernel_checks.RELATIVE_TOLERANCE``)."""


def _relative_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return ((out.double() - expected).norm() / expected.norm()).item()


def measure_shape(args: argparse.Namespace, shape: str, dtype: torch.dtype) -> dict:
    """Every config of ``SWEEP`` (and cuBLAS) on each projection of ``shape`` at ``args.rows`` rows."""
    projections = {}
    for name, (in_features, out_features, has_bias) in SKINNY_SHAPES[shape].items():
        in_features, out_features, weights, biases = projection_weights(
            in_features, out_features, has_bias, args, dtype
        )
        x = torch.randn(args.rows, in_features, device=args.device, dtype=dtype)
        torch_s = per_layer_seconds(F.linear, x, weights, biases, args.device, args.repeats)
        projections[name] = {"torch_us": torch_s * 1e6}
        processors = multiprocessors(torch.device(args.device))
        for index, config in enumerate(SWEEP):
            as_the_engine = engine_projection(name, in_features, args.rows, args.device, dtype, config)
            try:
                plain = skinny_linear(x, weights[0], biases[0], config=config)
                error = _relative_error(plain, x, weights[0], biases[0])
                if not error < ERROR_BOUND:
                    raise ValueError(f"relative error {error:.2e} against float64")
                seconds = per_layer_seconds(as_the_engine, x, weights, biases, args.device, args.repeats)
                figures = {"us": seconds * 1e6, "relative_error": error}
            except Exception as failure:  # a config that does not compile or run is reported, and the sweep goes on
                figures = {"us": None, "error": f"{type(failure).__name__}: {str(failure)[:300]}"}
            figures["splits"] = skinny_launch(args.rows, in_features, out_features, processors, config)[2]
            projections[name][str(index)] = figures
    return projections


def summarise(projections: dict) -> dict:
    """Per config, the block's microseconds (None where a projection failed); the best config and its savings."""
    blocks = {}
    for index in range(len(SWEEP)):
        times = [figures[str(index)]["us"] for figures in projections.values()]
        blocks[str(index)] = None if None in times else sum(times)
    torch_block = sum(figures["torch_us"] for figures in projections.values())
    ran = {index: us for index, us in blocks.items() if us is not None}
    best = min(ran, key=ran.get) if ran else None
    default = blocks["0"]
    return {
        "block_us": blocks,
        "torch_block_us": torch_block,
        "best": None if best is None else int(best),
        "best_config": None if best is None else asdict(SWEEP[int(best)]),
        "best_saved_us_per_28_layer_step_over_default": (
            None if best is None or default is None else (default - ran[best]) * GRAPH_CALLS
        ),
        "best_saved_us_per_28_layer_step_over_torch": (
            None if best is None else (torch_block - ran[best]) * GRAPH_CALLS
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_arguments(parser)
    parser.add_argument("--rows", type=int, default=1)
    args = parse_with_smoke(parser, dict(repeats=2))
    dtype = kernel_dtype(args.device)
    result = {
        "smoke": args.smoke,
        "dtype": str(dtype).removeprefix("torch."),
        "rows": args.rows,
        "environment": environment(args.device),
        "configs": [asdict(config) for config in SWEEP],
        "shapes": {},
    }
    name = f"gpu_skinny_sweep_{torch.device(args.device).type}"
    for shape in SKINNY_SHAPES:
        projections = measure_shape(args, shape, dtype)
        result["shapes"][shape] = {"projections": projections, **summarise(projections)}
        write_result(args.out, name, result)  # after each shape: a call cut short keeps what it measured
    if args.smoke:
        print("SMOKE RUN: not a GPU figure")
    for shape, figures in result["shapes"].items():
        print(f"{shape}: cuBLAS block {figures['torch_block_us']:.1f} us at {args.rows} row(s)")
        for index, block_us in figures["block_us"].items():
            shown = "failed" if block_us is None else f"{block_us:.1f} us"
            print(f"  {index:>2} {shown:>10}  {SWEEP[int(index)]}")
        print(f"  best: {figures['best']}, saves {figures['best_saved_us_per_28_layer_step_over_default']} us per step")


if __name__ == "__main__":
    main()
