"""The paged decode kernel's tiling (``kernels.paged_attention.PagedConfig``) swept on one GPU:

    python benchmarks/gpu_paged_sweep.py [--repeats 5]    # on a GPU: under a minute
    python benchmarks/gpu_paged_sweep.py --smoke          # CPU-sized: checks the script in seconds

Each regime runs the kernel as the engine does (the new token's K/V written and q and the new key rotated in the
kernel, split-K by ``decode_splits``), at Qwen2.5-7B's attention shape (``gpu_kernels``: 28 query / 4 KV heads of
128, 16-token blocks), bf16, timed inside a CUDA graph of 28 calls (a decode step's layers): batch 1 at 256 and 4,096
cached tokens (G1's attention) and 256 sequences at 1,024 tokens (G2's batch, where session 44 measured the kernel at
2.6x its KV read). Per regime: each tiling's microseconds per call, its output against the default tiling's, the best
and its speed-up over the default. A tiling that fails to compile or run is reported with its error, not chosen.

Why: which tiling is fastest is for a GPU to say. Compiled for sm_90 as the JIT specialises these launches
(``benchmarks/kernel_resources.py``), none of them spills (104-186 registers), and the walk's block-table, key and
value loads are asynchronous copies pipelined ``num_stages`` deep, so the sweep also moves the pipeline's depth.

On CPU (or with ``--smoke``) every tiling runs the torch path: the figures check the script, not the kernel. Writes
``benchmarks/results/gpu_paged_sweep_<device>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch
from gpu_common import add_kernel_arguments, environment, kernel_dtype, parse_with_smoke, write_result
from gpu_kernels import HEAD_DIM, decode_inputs, new_token_inputs
from gpu_timing import graphed_seconds

from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig, paged_decode_attention

SWEEP = (
    DEFAULT_PAGED_CONFIG,
    PagedConfig(num_warps=8),
    PagedConfig(block_tokens=32),
    PagedConfig(block_tokens=32, num_warps=2),
    PagedConfig(block_tokens=16),
    PagedConfig(block_tokens=128, num_warps=8),
    PagedConfig(num_stages=1),
    PagedConfig(num_stages=2),
    PagedConfig(block_tokens=32, num_stages=4),
    PagedConfig(last_combines=False),
    PagedConfig(max_splits=1),
    PagedConfig(max_splits=2),
    PagedConfig(dependent_launch=True),
)
"""The default; more warps; shorter tiles (on fewer warps too) and shortest tiles (more, cheaper iterations); longer
tiles on more warps (fewer iterations); the walk unpipelined and pipelined 2 deep (the default 3), and shorter tiles
pipelined 4 deep (the same bytes in flight as the default); split-K's combine as a kernel of its own (session 46's
default: against it, what the last program's combine saves at batch 1); one split per pair (no partial results, no
combine: a pipelined walk of every tile) and at most two (session 48's batch-1 profile: 8.2 us a layer for a few
hundred KB, its time the chain of dependent loads that split-K's partials and combine end); the default launched
with programmatic dependent launch (each call may start while the one before it ends)."""


REGIMES = {"batch1_256": (1, 256), "batch1_4096": (1, 4096), "batch256_1024": (256, 1024)}
"""(sequences, cached tokens) of each regime."""

ERROR_BOUND = 1.6e-2
"""bf16's bound on a tiling's relative difference from the default's output (each a few roundings from exact)."""


def engine_call(seqs: int, context: int, device: str, dtype: torch.dtype):
    """``call(config)``: the kernel on ``seqs`` sequences of ``context`` cached tokens as a decode step runs it."""
    q, key_cache, value_cache, block_tables, context_lens = decode_inputs(device, seqs, context, dtype)
    new_tokens = new_token_inputs(key_cache, block_tables, context, dtype)

    def call(config: PagedConfig) -> torch.Tensor:
        return paged_decode_attention(
            q, key_cache, value_cache, block_tables, context_lens, scale=HEAD_DIM**-0.5, config=config, **new_tokens
        )

    return call


def measure_regime(args: argparse.Namespace, seqs: int, context: int, dtype: torch.dtype) -> dict:
    call = engine_call(seqs, context, args.device, dtype)
    expected = call(DEFAULT_PAGED_CONFIG).double()
    configs = {}
    for index, config in enumerate(SWEEP):
        try:
            error = ((call(config).double() - expected).norm() / expected.norm()).item()
            if not error < ERROR_BOUND:
                raise ValueError(f"relative difference {error:.2e} from the default tiling's output")
            seconds = graphed_seconds(lambda config=config: call(config), args.device, args.repeats)
            configs[str(index)] = {"us": seconds * 1e6, "relative_difference": error}
        except Exception as failure:  # a tiling that does not compile or run is reported, and the sweep goes on
            configs[str(index)] = {"us": None, "error": f"{type(failure).__name__}: {str(failure)[:300]}"}
    ran = {index: figures["us"] for index, figures in configs.items() if figures["us"] is not None}
    best = min(ran, key=ran.get) if ran else None
    default = configs["0"]["us"]
    return {
        "seqs": seqs,
        "context": context,
        "configs": configs,
        "best": None if best is None else int(best),
        "best_config": None if best is None else asdict(SWEEP[int(best)]),
        "best_speedup_over_default": None if best is None or default is None else default / ran[best],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_arguments(parser)
    args = parse_with_smoke(parser, dict(repeats=2))
    dtype = kernel_dtype(args.device)
    result = {
        "smoke": args.smoke,
        "dtype": str(dtype).removeprefix("torch."),
        "environment": environment(args.device),
        "configs": [asdict(config) for config in SWEEP],
        "regimes": {},
    }
    name = f"gpu_paged_sweep_{torch.device(args.device).type}"
    for regime, (seqs, context) in REGIMES.items():
        if args.smoke:
            seqs, context = min(seqs, 4), min(context, 64)
        result["regimes"][regime] = measure_regime(args, seqs, context, dtype)
        write_result(args.out, name, result)  # after each regime: a call cut short keeps what it measured
    if args.smoke:
        print("SMOKE RUN: not a GPU figure")
    for regime, figures in result["regimes"].items():
        print(f"{regime}: {figures['seqs']} sequence(s) x {figures['context']} tokens")
        for index, config_figures in figures["configs"].items():
            shown = "failed" if config_figures["us"] is None else f"{config_figures['us']:.1f} us"
            print(f"  {index} {shown:>10}  {SWEEP[int(index)]}")
        print(f"  best: {figures['best']}, {figures['best_speedup_over_default']}x the default")


if __name__ == "__main__":
    main()
