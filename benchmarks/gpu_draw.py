"""The decode step's draw on one GPU, eager against compiled (``engine.decode_compile.compile_draw``), as the
captured decode step holds it:

    python benchmarks/gpu_draw.py [--vocab 151936] [--repeats 5]    # on a GPU: about a minute, most of it compiling
    python benchmarks/gpu_draw.py --smoke                            # CPU-sized: checks the script in seconds

For greedy and sampled batches of 1 and 256 rows of bf16 logits, ``sampler.draw_rows`` eagerly and compiled by
Inductor, each timed inside a CUDA graph (``gpu_timing.graphed_seconds``), and the two sides' tokens compared. Per
case: microseconds per draw, the compiled draw's speed-up, whether the tokens are equal (greedy: always; sampled:
but where a target lies within the sums' rounding of a token's cumulative mass). On session 44's H200 profile the
eager greedy draw was about a dozen kernels, 25-30 µs of G1's 1.7 ms step.

On CPU (or with ``--smoke``) both sides run eagerly: the figures check the script, not the compiler. Writes
``benchmarks/results/gpu_draw_<device>.json`` (after each case) and prints a table.
"""

from __future__ import annotations

import argparse

import torch
from gpu_common import add_kernel_arguments, environment, kernel_dtype, parse_with_smoke, write_result
from gpu_timing import graphed_seconds

from spmd_rlhf.engine.decode_compile import compile_draw
from spmd_rlhf.engine.sampler import GREEDY, SAMPLED, draw_rows, row_uniforms

KINDS = {"greedy": GREEDY, "sampled": SAMPLED}
ROWS = (1, 256)


def draw_inputs(rows: int, vocab: int, kind: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (bf16 on CUDA), the sampling buffer (T 0.8 for sampled rows, 1 for greedy ones; nothing filtered) and
    the rows' uniforms, as ``decode_graphs.StaticDecodeStep`` holds them."""
    dtype = kernel_dtype(device)
    generator = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn(rows, vocab, device=device, generator=generator).mul_(3).to(dtype)
    sampling = torch.zeros(4, rows, dtype=torch.float64, device=device)
    sampling[0] = 1.0 if kind == GREEDY else 0.8
    sampling[2] = float("inf")
    sampling[3] = 1.0 if kind == GREEDY else 0.0
    uniforms = torch.tensor(row_uniforms(list(range(rows)), [7] * rows), dtype=torch.float64, device=device)
    return logits, sampling, uniforms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_arguments(parser)
    parser.add_argument("--vocab", type=int, default=151_936)
    args = parse_with_smoke(parser, dict(vocab=4096, repeats=2))
    compiles = torch.device(args.device).type == "cuda" and not args.smoke
    compiled = compile_draw("inductor") if compiles else draw_rows
    result = {"smoke": args.smoke, "vocab": args.vocab, "compiled": compiles, "environment": environment(args.device)}
    result["cases"] = {}
    name = f"gpu_draw_{torch.device(args.device).type}"
    for label, kind in KINDS.items():
        for rows in ROWS:
            inputs = draw_inputs(rows, args.vocab, kind, args.device)
            eager_s = graphed_seconds(lambda: draw_rows(*inputs, kind=kind), args.device, args.repeats)
            compiled_s = graphed_seconds(lambda: compiled(*inputs, kind=kind), args.device, args.repeats)
            equal = torch.equal(draw_rows(*inputs, kind=kind)[0], compiled(*inputs, kind=kind)[0])
            result["cases"][f"{label}_{rows}"] = {
                "eager_us": eager_s * 1e6,
                "compiled_us": compiled_s * 1e6,
                "speedup": eager_s / compiled_s,
                "tokens_equal": equal,
            }
            write_result(args.out, name, result)  # after each case: a call cut short keeps what it measured
    if args.smoke:
        print("SMOKE RUN: not a GPU figure")
    print(f"draw of {args.vocab}-token logits, {'compiled by Inductor' if compiles else 'eager on both sides'}")
    print("| case | eager us | compiled us | speed-up | tokens equal |")
    print("| --- | --- | --- | --- | --- |")
    for case, figures in result["cases"].items():
        print(
            f"| {case} | {figures['eager_us']:.1f} | {figures['compiled_us']:.1f} | {figures['speedup']:.2f} | "
            f"{figures['tokens_equal']} |"
        )


if __name__ == "__main__":
    main()
