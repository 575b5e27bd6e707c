"""Expert parallelism's traffic and time on this machine: one mixture-of-experts layer split over ``ep`` ranks
(``models.expert_parallel.ParallelExperts``, gloo on CPU), each rank routing its own tokens, against the whole layer
on one rank with the same tokens per rank.

    python benchmarks/expert_parallel.py [--ep 2] [--hidden 2048] [--expert-width 768] [--experts 16] [--top-k 8]
        [--tokens 1024] [--dtype float32] [--repeats 3]

It starts ``--ep`` processes itself (torchrun). What it measures, per layer and rank:

- bytes sent to other ranks by the dispatch all-to-all (each ``all_to_all_single`` the layer issues, read by a
  dispatch mode from its split sizes: the rows bound for another rank times the row's bytes), against the analytical
  count under uniform routing (``expert_parallel.all_to_all_bytes``: ``tokens * k * H * b * (ep - 1) / ep``); the
  router has random weights, so the routing is near uniform and the ratio near 1;
- all-to-alls per forward + backward (the counts exchange, the copies there and back, and their backward);
- forward + backward seconds (median of ``--repeats`` after one untimed run) of the ep layer and of the whole layer
  on one rank over the same tokens: their ratio is what the exchange and the smaller expert GEMMs cost together.

``--experts`` defaults to 16 (Qwen3-30B-A3B has 128; its widths are the other defaults): the whole-layer baseline
holds every expert in one process. Writes ``benchmarks/results/expert_parallel_ep<ep>_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from spmd_rlhf.models.expert_parallel import ParallelExperts, all_to_all_bytes
from spmd_rlhf.models.moe import Experts, TopKRouter

RESULTS = Path(__file__).resolve().parent / "results"


class AllToAllBytes(TorchDispatchMode):
    """Counts the all-to-alls issued while active and the bytes each sends to other ranks (its input rows outside
    this rank's own split)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.calls, self.bytes_to_others = rank, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "all_to_all_single":
            self.calls += 1
            tensor, input_splits = args[0], args[2]
            if tensor.dim() == 2:  # the copies or their outputs (the counts exchange is a few integers)
                splits = list(input_splits)
                self.bytes_to_others += (sum(splits) - splits[self.rank]) * tensor.shape[1] * tensor.element_size()
        return func(*args, **(kwargs or {}))


def timed(module: torch.nn.Module, x: torch.Tensor, router: TopKRouter, repeats: int) -> float:
    seconds = []
    for _ in range(repeats + 1):
        module.zero_grad(set_to_none=True)
        inputs = x.detach().requires_grad_(True)
        dist.barrier()
        started = time.perf_counter()
        module(inputs, router(inputs)).square().mean().backward()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)  # the same whole layer and router on every rank
    router = TopKRouter(args.hidden, args.experts, top_k=args.top_k, renormalize=True).to(dtype)
    whole = Experts(args.experts, args.hidden, args.expert_width).to(dtype)
    router.requires_grad_(False)
    split = ParallelExperts(whole, init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)))
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, generator=torch.Generator().manual_seed(100 + rank))

    with AllToAllBytes(rank) as counted:
        split(x.detach().requires_grad_(True), router(x)).square().mean().backward()
    sent = torch.tensor([float(counted.bytes_to_others)])
    dist.all_reduce(sent)
    split_s, whole_s = timed(split, x, router, args.repeats), timed(whole, x, router, args.repeats)
    dtype_bytes = torch.finfo(dtype).bits // 8
    analytical = all_to_all_bytes(
        tokens=args.tokens, top_k=args.top_k, hidden=args.hidden, ep=ep, dtype_bytes=dtype_bytes
    )
    # Per rank and direction: the copies out, their outputs back, and the same two again in the backward.
    measured = float(sent) / ep / 4
    if rank == 0:
        result = {
            "benchmark": "expert_parallel",
            "device": "cpu",
            "torch": torch.__version__,
            "config": {**vars(args), "ep": ep},
            "bytes_per_layer_and_direction_measured": measured,
            "bytes_per_layer_and_direction_analytical": analytical,
            "measured_over_analytical": measured / analytical,
            "all_to_alls_per_forward_backward": counted.calls,
            "ep_seconds": split_s,
            "one_rank_seconds": whole_s,
            "ep_over_one_rank": split_s / whole_s,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"expert_parallel_ep{ep}_cpu.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"expert parallelism, ep={ep}: {args.tokens} tokens per rank x top-{args.top_k} of {args.experts} experts "
            f"({args.hidden} -> {args.expert_width}), {args.dtype}, forward + backward\n"
            f"| figure | value |\n| --- | --- |\n"
            f"| bytes to other ranks per layer and direction, measured | {measured:,.0f} |\n"
            f"| the same, analytical (uniform routing) | {analytical:,.0f} |\n"
            f"| measured / analytical | {measured / analytical:.3f} |\n"
            f"| all-to-alls per forward + backward | {counted.calls} |\n"
            f"| seconds, ep={ep} / one rank, whole layer | {split_s:.3f} / {whole_s:.3f} ({split_s / whole_s:.2f}x) |\n"
            f"wrote {path}"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-width", type=int, default=768)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ep}", __file__, "--worker"]
    for name in ("hidden", "expert_width", "experts", "top_k", "tokens", "dtype", "repeats", "out"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    raise SystemExit(subprocess.run(command, env=environment, check=False).returncode)


if __name__ == "__main__":
    main()
