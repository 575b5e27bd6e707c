"""Sequence parallelism on 2 gloo CPU ranks at a real model's widths: one training forward and backward of a packed
row through a Qwen2.5-0.5B-shaped decoder (hidden 896, MLP 4864, 14 / 2 heads, a 151,936-token vocabulary;
``--layers`` of its 24 layers) split over tp = 2, with and without ``sequence_parallel``, eager blocks, bf16.

    python benchmarks/sequence_parallel_cpu.py [--layers 4] [--tokens 4096] [--repeats 3]

Per rank: the bytes autograd keeps for the backward, parameters left out
(``metrics.peak_memory.saved_activation_bytes``: what a GPU would hold between the forward and the backward), their
ratio with / without (below 1: saved), and the median seconds of the forward and backward on these cores. Writes
``benchmarks/results/sequence_parallel_cpu.json``. Runs itself under torchrun (``--worker``).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rlhf.metrics.peak_memory import saved_activation_bytes
    from spmd_rlhf.models import load_model
    from spmd_rlhf.models.parallelize import parallelize

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    # The model's own vocabulary: ids past it would be nobody's under the vocabulary-parallel embedding (zeros).
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    lengths = [args.tokens // 4 - 3, args.tokens // 4 + 5, args.tokens // 4, args.tokens // 4 - 1]  # packed, odd
    inputs = {
        "input_ids": torch.randint(3, vocab, (1, sum(lengths)), generator=generator),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        "max_seqlen": max(lengths),
        "output_positions": torch.arange(0, sum(lengths), 8),  # a response position in eight
    }
    results = {}
    for split in (False, True):
        model = load_model(args.model_dir, head="lm", dtype=torch.bfloat16)
        parallelize(model, tp_mesh=mesh, dp_mesh=None, sequence_parallel=split)
        kept = saved_activation_bytes(model, functools.partial(model, **inputs))
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            model(**inputs).float().pow(2).mean().backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        results["sequence_parallel" if split else "tensor_parallel"] = {
            "saved_bytes": kept,
            "seconds": statistics.median(times),
        }
        del model
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from gpu_common import environment, run_workers, shape_fields, write_result

    from spmd_rlhf.tiny.model import make_tiny

    with tempfile.TemporaryDirectory(prefix="sequence_parallel_") as scratch:
        # The 0.5B shape's widths and its 151,936-row vocabulary (``model_vocab_size``: a small tokenizer).
        model_dir = make_tiny(out_dir=f"{scratch}/model", **shape_fields("0.5b", layers=args.layers))
        arguments = [f"--model-dir={model_dir}", f"--layers={args.layers}", f"--tokens={args.tokens}"]
        measured = run_workers(__file__, [*arguments, f"--repeats={args.repeats}"])
    plain, split = measured["tensor_parallel"], measured["sequence_parallel"]
    ratio = split["saved_bytes"] / plain["saved_bytes"]
    print("| tp = 2, per rank | saved for the backward (MiB) | forward + backward (s) |\n| --- | --- | --- |")
    for name, row in (("without sequence parallelism", plain), ("with", split)):
        print(f"| {name} | {row['saved_bytes'] / 2**20:.1f} | {row['seconds']:.2f} |")
    print(f"saved bytes with / without: {ratio:.3f}")
    result = {
        "benchmark": "sequence_parallel_cpu",
        "layers": args.layers,
        "tokens": args.tokens,
        "tp": 2,
        "shape": {key: value for key, value in shape_fields("0.5b", layers=args.layers).items()},
        "tensor_parallel": plain,
        "sequence_parallel": split,
        "saved_bytes_ratio": ratio,
    }
    write_result(args.out, "sequence_parallel_cpu", {**result, "environment": environment("cpu")})


if __name__ == "__main__":
    main()
