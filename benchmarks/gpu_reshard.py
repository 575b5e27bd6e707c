"""G5: the 3D-HybridEngine's training -> generation reshard on GPU \
against the all-gather bound measured in the same run,
Qwen2.5-1.5B-shaped random model, bf16 compute.

    torchrun --nproc-per-node N benchmarks/gpu_reshard.py [--shape 1.5b] [--layouts dpNtp1pp1:1 ...] [--repeats 5]
    python benchmarks/gpu_reshard.py [--shape 1.5b]   # one GPU: see below
    python benchmarks/gpu_reshard.py --smoke          # tiny model, CPU-sized: checks the script in seconds

The measurement is ``benchmarks/reshard.py``'s (its ``ReshardingActor``, ``summarize`` and ``table``; read its
docstring for the method): per layout ``dp{D}tp{T}pp{P}:{tp_g}``, the median over ``--repeats`` rounds of the
slowest rank's ``hybrid.generation_model`` time, against the bound = the bytes a rank must receive at the per-rank
receive rate of the engine's own all-gather of the whole model in block-sized messages, timed in the same rounds.
Goal (G5): ratio to that bound <= 1.3.

With one rank (one GPU) nothing crosses devices: a rank already holds all it needs, the all-gather bound is 0 s and a
ratio to it is undefined, so the JSON says ``"degenerate"`` and gives ``ratio_to_bound: null``. What the switch
then costs is a copy: it reads the float32 master weights and writes the generation copy in the compute dtype, so
the run reports instead its ratio to that copy bound (bytes read + written at the bandwidth of a large
device-to-device copy measured in the same run); this is not the G5 figure. Writes
``benchmarks/results/gpu_reshard_<shape>_<device>_<world>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from gpu_common import (
    add_model_arguments,
    copy_bandwidth,
    default_dtype,
    environment,
    meets_goal,
    parse_with_smoke,
    shaped_model,
    write_result,
)
from reshard import ReshardingActor, parse_layout, summarize, table

from spmd_rlhf.config import load_config
from spmd_rlhf.runtime import Coordinator, ResourcePool, launch

RATIO_GOAL = 1.3
DEGENERATE = (
    "world size 1: no bytes cross devices, so the all-gather bound is 0 s and a ratio to it is undefined; "
    "ratio_to_copy_bound (float32 master read + generation copy written at the measured copy bandwidth) is "
    "reported instead and is not the G5 figure"
)

SMOKE = dict(shape="smoke", repeats=1, copy_mib=16)


def default_layouts(world: int) -> list[str]:
    """Pure FSDP over every rank, and with an even world, TP 2 inside FSDP generating at TP 1 (the micro-DP gather)."""
    layouts = [f"dp{world}tp1pp1:1"]
    if world > 1 and world % 2 == 0:
        layouts.append(f"dp{world // 2}tp2pp1:1")
    return layouts


def single_rank_row(timings: list[dict], memory: list[dict], *, dtype: torch.dtype, copy_bytes_per_s: float) -> dict:
    """The one-rank row: the switch time against the copy bound (see the module docstring), never the all-gather's."""
    (timing,), (rank_memory,) = timings, memory
    seconds = {switch: statistics.median(values) for switch, values in timing["seconds"].items()}
    generation_bytes = rank_memory["generation_shard_bytes"]
    moved_bytes = generation_bytes // dtype.itemsize * torch.float32.itemsize + generation_bytes
    copy_bound_s = moved_bytes / copy_bytes_per_s
    return {
        "seconds": seconds,
        "degenerate": DEGENERATE,
        "ratio_to_bound": None,
        "generation_shard_bytes": generation_bytes,
        "copy_moved_bytes": moved_bytes,
        "copy_bytes_per_s": copy_bytes_per_s,
        "copy_bound_s": copy_bound_s,
        "ratio_to_copy_bound": seconds["to_generation"] / copy_bound_s,
        "naive_ratio": seconds["naive"] / seconds["to_generation"],
        "peak_increase": rank_memory["peak_increase"],
        "freed_by_refcount": rank_memory["freed_by_refcount"],
        "per_rank": {"timings": timings, "memory": memory},
    }


def run(coordinator: Coordinator, args: argparse.Namespace) -> None:
    world = coordinator.world_size
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or default_dtype(torch.device(device).type)
    real_run = torch.device(device).type == "cuda" and not args.smoke
    results: dict[str, dict] = {}
    with shaped_model(args.shape, args.model_dir) as model_dir:
        for layout in args.layouts or default_layouts(world):
            dims, tp_g = parse_layout(layout)
            config = load_config(
                None,
                [
                    f"model.path={model_dir}",
                    f"model.dtype={dtype}",
                    f"actor.tp={dims.tp}",
                    f"actor.pp={dims.pp}",
                    f"rollout.tp={tp_g}",
                ],
            )
            ranks = dims.pp * dims.dp * dims.tp
            actor = coordinator.spawn(
                ReshardingActor,
                config,
                name=f"actor_{layout}",
                pool=ResourcePool(range(ranks)),
                dims=dims,
            )
            timings = actor.time_switches([args.repeats] * ranks).result()
            memory = actor.measure_memory([None] * ranks).result()
            if ranks == 1:
                # Rank 0 is this process, so the copy probe runs on the device the switch ran on.
                bandwidth = copy_bandwidth(device, nbytes=args.copy_mib * 2**20)
                results[layout] = single_rank_row(
                    timings, memory, dtype=getattr(torch, dtype), copy_bytes_per_s=bandwidth
                )
            else:
                results[layout] = summarize(timings, memory)
            ratio = results[layout]["ratio_to_bound"]
            results[layout]["meets_goal"] = meets_goal(ratio, RATIO_GOAL, at_least=False, real_run=real_run)
            print(f"{layout}: train -> gen {results[layout]['seconds']['to_generation']:.4f} s", flush=True)

    result = {
        "benchmark": "gpu_reshard",
        "smoke": args.smoke,
        "shape": args.shape,
        "dtype": dtype,
        "repeats": args.repeats,
        "goal": f"ratio_to_bound <= {RATIO_GOAL}",
        "results": results,
        "environment": environment(device),
    }
    print(
        f"\nreshard train -> gen, qwen2 {args.shape}, {world} x {result['environment']['device_name']}, {dtype}, "
        f"medians of {args.repeats} rounds{', SMOKE RUN: not a GPU figure' if args.smoke else ''}"
    )
    several = {layout: row for layout, row in results.items() if "degenerate" not in row}
    if several:
        print(table(several))
    for layout, row in results.items():
        if "degenerate" in row:
            print(
                f"{layout}: train -> gen {row['seconds']['to_generation']:.4f} s; "
                f"copy bound {row['copy_bound_s']:.4f} s "
                f"({row['copy_moved_bytes'] / 1e9:.2f} GB at {row['copy_bytes_per_s'] / 1e9:.0f} GB/s), ratio "
                f"{row['ratio_to_copy_bound']:.2f}; no all-gather ratio: {row['degenerate']}"
            )
    write_result(args.out, f"gpu_reshard_{args.shape}_{result['environment']['device']}_{world}", result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, default_shape="1.5b")
    parser.add_argument("--layouts", nargs="+", help="dp{D}tp{T}pp{P}:{tp_g} each; default: see default_layouts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype; default bfloat16 on cuda")
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe's copy (one rank)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parse_with_smoke(parser, SMOKE)
    launch(lambda coordinator: run(coordinator, args))


if __name__ == "__main__":
    main()
