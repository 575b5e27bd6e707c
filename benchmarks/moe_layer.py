"""A mixture-of-experts layer's two expert paths on this machine: grouped GEMMs (``torch._grouped_mm`` over the token
copies sorted by expert, no host sync) against the looped experts (one ``F.linear`` triple per expert, the per-expert
counts read on the host), forward + backward, at Qwen3-30B-A3B's widths by default.

    python benchmarks/moe_layer.py [--hidden 2048] [--expert-width 768] [--experts 128] [--top-k 8] [--tokens 1024]
        [--dtype float32] [--repeats 3]

The router (``models.moe.TopKRouter``) and the experts (``models.moe.Experts``) are the model's own modules with
random weights; both paths run on the same inputs and routing, and their outputs and gradients are compared. Each
timing is the median of ``--repeats`` runs after one untimed one. Model FLOPs: 3 GEMMs of ``2 · H · I`` per routed
token copy forward, twice that backward. Writes ``benchmarks/results/moe_layer_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spmd_rlhf.models.moe import Experts, TopKRouter, expert_load, grouped_mm_supported

RESULTS = Path(__file__).resolve().parent / "results"


def timed(experts: Experts, x: torch.Tensor, router: TopKRouter, *, repeats: int) -> tuple[float, dict]:
    """Median seconds of forward + backward, and the output and gradients of the last run."""
    seconds = []
    for _ in range(repeats + 1):
        experts.zero_grad(set_to_none=True)
        inputs = x.detach().requires_grad_(True)
        started = time.perf_counter()
        out = experts(inputs, router(inputs))
        out.square().mean().backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    grads = {name: param.grad for name, param in experts.named_parameters()}
    return statistics.median(seconds[1:]), {"out": out.detach(), "input": inputs.grad, **grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)

    torch.manual_seed(0)
    with torch.device(device):
        router = TopKRouter(args.hidden, args.experts, top_k=args.top_k, renormalize=True).to(dtype)
        experts = Experts(args.experts, args.hidden, args.expert_width).to(dtype)
        x = torch.randn(args.tokens, args.hidden, dtype=dtype)
    router.requires_grad_(False)  # one routing for both paths; the experts' own work is what differs
    load = expert_load(router(x), args.experts).float()
    if not grouped_mm_supported(x, args.hidden, args.expert_width):
        raise SystemExit(f"torch._grouped_mm does not serve {args.dtype} on {device} with this torch")

    results = {}
    for name, grouped in (("grouped", True), ("looped", False)):
        experts.grouped_mm = grouped
        results[name] = timed(experts, x, router, repeats=args.repeats)
    (grouped_s, grouped_out), (looped_s, looped_out) = results["grouped"], results["looped"]
    max_diff = max((grouped_out[key].float() - looped_out[key].float()).abs().max().item() for key in grouped_out)
    flops = 3 * 3 * 2 * args.hidden * args.expert_width * args.tokens * args.top_k  # 3 GEMMs, forward + 2x backward
    result = {
        "benchmark": "moe_layer",
        "device": str(device),
        "torch": torch.__version__,
        "config": vars(args),
        "expert_load_max_over_mean": (load.max() / load.mean()).item(),
        "grouped_s": grouped_s,
        "looped_s": looped_s,
        "looped_over_grouped": looped_s / grouped_s,
        "grouped_gflops_per_s": flops / grouped_s / 1e9,
        "looped_gflops_per_s": flops / looped_s / 1e9,
        "max_abs_diff_outputs_and_gradients": max_diff,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"moe_layer_{device.type}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"MoE layer, {args.tokens} tokens x top-{args.top_k} of {args.experts} experts ({args.hidden} -> "
        f"{args.expert_width}), {args.dtype} on {device}, forward + backward\n"
        f"| path | seconds | GFLOP/s |\n| --- | --- | --- |\n"
        f"| grouped GEMM | {grouped_s:.3f} | {result['grouped_gflops_per_s']:.1f} |\n"
        f"| looped experts | {looped_s:.3f} | {result['looped_gflops_per_s']:.1f} |\n"
        f"looped / grouped: {result['looped_over_grouped']:.2f}x; outputs and gradients differ by at most "
        f"{max_diff:.2e}; expert load max/mean {result['expert_load_max_over_mean']:.2f}\nwrote {path}"
    )


if __name__ == "__main__":
    main()
