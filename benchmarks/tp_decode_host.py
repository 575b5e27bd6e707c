"""Host time of one decode-shaped forward (one new token per row) of a tensor-parallel generation copy: its modules
as ``parallelize(..., gather_logits=True)`` leaves them (the "dtensor" path: until session 43 DTensor's hooks and
dispatch in every split layer; since then ``tp_plan``'s local-shard forwards with Megatron's autograd operators and a
``to_local()`` per call, the LM head through DTensor) against the same copy on local shards without autograd
(``models.local_tensor_parallel.run_locally``), on 2 gloo ranks, with the one-rank forward as the floor. A tiny
model of many layers (hidden 64, 28 layers) so that the time is the host's, not the arithmetic.

    python benchmarks/tp_decode_host.py [--layers 28] [--rows 1 64] [--repeats 30]

Writes ``benchmarks/results/tp_decode_host_cpu.json``. Runs itself under torchrun (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def timed(model: torch.nn.Module, rows: int, repeats: int, *, synchronize: bool) -> float:
    """Median seconds of ``repeats`` forwards of ``rows`` one-token rows (after two warm-up calls)."""
    input_ids = torch.arange(rows)[:, None] + 5
    position_ids = torch.full((rows, 1), 7)
    times = []
    with torch.no_grad():
        for step in range(repeats + 2):
            if synchronize:
                dist.barrier()
            start = time.perf_counter()
            model(input_ids, position_ids)
            if step >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rlhf.models import load_model
    from spmd_rlhf.models.local_tensor_parallel import run_locally
    from spmd_rlhf.models.merged_linear import merge_projections
    from spmd_rlhf.models.parallelize import parallelize

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {}
    for path in ("dtensor", "local"):
        model = load_model(args.model_dir, dtype=torch.float32)
        parallelize(model, tp_mesh=mesh, dp_mesh=None, gather_logits=True, role="rollout")
        model.requires_grad_(False).eval()
        merge_projections(model)
        if path == "local":
            run_locally(model, mesh)
        results[path] = {rows: timed(model, rows, args.repeats, synchronize=True) for rows in args.rows}
    if dist.get_rank() == 0:
        whole = load_model(args.model_dir, dtype=torch.float32).eval()
        merge_projections(whole.requires_grad_(False))
        results["one rank"] = {rows: timed(whole, rows, args.repeats, synchronize=False) for rows in args.rows}
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from gpu_common import environment, run_workers, write_result

    from spmd_rlhf.tiny.model import make_tiny

    with tempfile.TemporaryDirectory(prefix="tp_decode_host_") as scratch:
        model_dir = make_tiny(
            family="qwen2", out_dir=f"{scratch}/model", hidden_size=64, num_layers=args.layers, vocab_size=512
        )
        arguments = [f"--model-dir={model_dir}", f"--repeats={args.repeats}", "--rows", *map(str, args.rows)]
        measured = run_workers(__file__, arguments)
    rows = []
    print("| rows | one rank ms | tp=2 DTensor ms | tp=2 local ms | DTensor / local |\n|" + " --- |" * 5)
    for count in map(str, args.rows):
        one, dtensor, local = (measured[path][count] for path in ("one rank", "dtensor", "local"))
        rows.append({"rows": int(count), "one_rank_s": one, "dtensor_s": dtensor, "local_s": local})
        print(f"| {count} | {one * 1e3:.2f} | {dtensor * 1e3:.2f} | {local * 1e3:.2f} | {dtensor / local:.1f} |")
    result = {"benchmark": "tp_decode_host", "layers": args.layers, "tp": 2, "rows": rows}
    write_result(args.out, "tp_decode_host_cpu", {**result, "environment": environment("cpu")})


if __name__ == "__main__":
    main()
