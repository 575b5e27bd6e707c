"""Host overhead of training, counted exactly on CPU: what the host launches per layer and where it waits.

    python benchmarks/host_overhead.py --train [--layers 6 12] [--rows 8] [--length 64] [--micro-batch 2]

``--train`` runs the real ``ActorWorker.update_actor`` (GRPO loss with the k3 KL term and an entropy bonus, AdamW,
gradient clipping) on one rank of a gloo job, FSDP2 over the one-rank DP mesh with one unit per layer
(``actor.fsdp_unit_mb=0``, as at 1.5B), on random tiny qwen2 models (``spmd_rlhf.tiny.model.make_tiny``), and counts
with ``spmd_rlhf.metrics.DispatchCounts`` around one update (after one warm-up update):

- dispatcher calls and non-view calls per layer per micro-batch: the difference between the two ``--layers`` models
  per layer, divided by the update's micro-batches (``--rows`` rows of ``--length`` tokens, ``--micro-batch`` rows
  each);
- scalar reads (``aten._local_scalar_dense``: ``.item()``, ``float()``, ``int()`` of a tensor; each a device sync on
  a GPU) per update at 2 and 8 micro-batches (``--rows`` x 2 rows), with the line that made each;
- FSDP's copies (``copy_``, ``split_with_sizes_copy``, ``all_gather_copy_in``, ``chunk_cat`` issued from FSDP's
  code) per micro-batch at dp = 1: the difference between the updates at 8 and 2 micro-batches, over 6.

- launches per layer per micro-batch, eager and with compiled decoder blocks (``model.compile=on``, Inductor's C++
  kernels): by the CPU profiler, since a dispatch mode turns TorchDynamo off: non-view ATen ops not inside another op
  or kernel (allocations, which launch nothing, left out), plus Inductor's kernels (named when generated with
  ``cpp.enable_kernel_profile``; caches off), the same slope between the two depths.

Goals (issue 33, on CPU): scalar reads per update independent of the micro-batch count; <= 50 launches per layer
per micro-batch with compiled decoder blocks; zero FSDP copies at dp = 1. Writes
``benchmarks/results/host_overhead_train.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter

import torch
import torch._inductor.config
import torch.distributed as dist
from gpu_common import environment, write_result
from gpu_update import GROUP_SIZE, synthetic_rollout
from host_overhead_decode import add_decode_arguments, decode_figures, decode_result

from spmd_rlhf.config import load_config
from spmd_rlhf.metrics.dispatch_counts import DispatchCounts
from spmd_rlhf.runtime import ParallelDims, RoleContext
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.workers import ActorWorker

NON_VIEW_GOAL_COMPILED = 50
"""Launches (non-view ATen ops, Inductor kernels) per layer per micro-batch with compiled blocks (issue 33)."""


def one_rank_actor(
    model_dir: str, *, rows: int, length: int, micro_batch: int, overrides: tuple[str, ...] = ()
) -> ActorWorker:
    """The real ``ActorWorker`` in this process as the only rank of a gloo job (started here on first use), set up to
    train on ``rows`` rows of ``length`` tokens, one optimizer step of ``micro_batch``-row micro-batches; ``overrides``:
    more ``key=value`` settings."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "algorithm.name=grpo",
            "algorithm.kl_penalty=loss",
            "algorithm.kl_estimator=k3",
            "algorithm.entropy_coef=0.01",
            "critic.enabled=false",
            f"rollout.n={GROUP_SIZE}",
            f"rollout.max_new_tokens={length}",
            f"data.batch_size={rows // GROUP_SIZE}",
            f"actor.mini_batch_size={rows}",
            f"actor.micro_batch_size={micro_batch}",
            "actor.fsdp_unit_mb=0",
            "actor.lr=1e-6",
            *overrides,
        ],
    )
    dims, ranks = ParallelDims(), (0,)
    groups = {"role": dist.new_group([0])}
    for name, partition in ActorWorker.process_groups(dims, ranks, config).items():
        groups[name] = dist.new_group(next(group for group in partition if 0 in group))
    context = RoleContext("actor", dims, ranks, 0, dims.build_mesh(ranks, "cpu"), torch.device("cpu"), groups)
    return ActorWorker(context, config)


def count_update(
    model_dir: str, *, rows: int, length: int, micro_batch: int, overrides: tuple[str, ...] = ()
) -> DispatchCounts:
    """Dispatcher counts of one ``update_actor`` after a warm-up update on the same rows."""
    actor = one_rank_actor(model_dir, rows=rows, length=length, micro_batch=micro_batch, overrides=overrides)
    batch = synthetic_rollout(rows, length, actor.model.module.args.vocab_size, seed=0)
    actor.update_actor(batch)
    with DispatchCounts() as counts:
        actor.update_actor(batch)
    return counts


ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like"})
"""Ops that only allocate (through the caching allocator on a GPU): no kernel."""


def _is_view(op: str) -> bool:
    packet = getattr(torch.ops.aten, op.removeprefix("aten::"), None)
    return packet is not None and any(getattr(packet, overload).is_view for overload in packet.overloads())


def _launch_name(event) -> str | None:
    """What a profiler event launches: an Inductor kernel (``cpp_fused_*``, named by ``cpp.enable_kernel_profile``),
    a non-view ATen op called from Python or from a compiled graph's wrapper, or nothing (a view, an allocation, or an
    op inside another op or kernel)."""
    name = event.name
    kernel = "cpp_fused" in name
    if not kernel and (not name.startswith("aten::") or _is_view(name) or name in ALLOCATIONS):
        return None
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::") or "cpp_fused" in parent.name:
            return None
        parent = parent.cpu_parent
    return "Inductor kernels" if kernel else name


def profiled_launches(model_dir: str, *, rows: int, length: int, micro_batch: int, compile_blocks: str) -> Counter[str]:
    """Launches (``_launch_name``) of one ``update_actor`` after a warm-up update, by the CPU profiler, which sees
    into compiled blocks where ``DispatchCounts`` cannot (TorchDynamo does not run a graph under a dispatch mode)."""
    actor = one_rank_actor(
        model_dir, rows=rows, length=length, micro_batch=micro_batch, overrides=(f"model.compile={compile_blocks}",)
    )
    batch = synthetic_rollout(rows, length, actor.model.module.args.vocab_size, seed=0)
    actor.update_actor(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        actor.update_actor(batch)
    return Counter(name for name in map(_launch_name, profile.events()) if name is not None)


def figure(name: str, value, goal: str, meets: bool | None, **details) -> dict:
    return {"figure": name, "value": value, "goal": goal, "meets_goal": meets, **details}


def train_figures(args: argparse.Namespace, scratch: str) -> list[dict]:
    small, large = args.layers
    micro_batches = -(-args.rows // args.micro_batch)
    counts = {}
    for layers in (small, large):
        model_dir = make_tiny(family="qwen2", out_dir=os.path.join(scratch, f"l{layers}"), num_layers=layers)
        counts[layers] = count_update(model_dir, rows=args.rows, length=args.length, micro_batch=args.micro_batch)
    per_layer = (large - small) * micro_batches

    def slope(value) -> float:
        return (value(counts[large]) - value(counts[small])) / per_layer

    reads = {}
    scalar_rows = 2 * args.rows
    for micro in (2, 8):
        reads[micro] = count_update(
            os.path.join(scratch, f"l{small}"), rows=scalar_rows, length=args.length, micro_batch=scalar_rows // micro
        )
    independent = reads[2].scalar_reads == reads[8].scalar_reads
    shape = f"{args.rows} rows x {args.length} tokens, {micro_batches} micro-batches of {args.micro_batch} rows"
    copies = {micro: sum(reads[micro].fsdp_copies.values()) for micro in (2, 8)}
    copies_per_micro_batch = (copies[8] - copies[2]) / (8 - 2)
    return [
        figure(
            "dispatcher calls per layer per micro-batch (eager)",
            slope(lambda c: c.total_calls),
            "none (context for the non-view count)",
            None,
            shape=shape,
        ),
        figure(
            "non-view calls per layer per micro-batch (eager)",
            slope(lambda c: c.non_view_calls),
            f"<= {NON_VIEW_GOAL_COMPILED} compiled; eager has no goal",
            None,
            shape=shape,
            by_op={
                name: (counts[large].calls[name] - counts[small].calls[name]) / per_layer
                for name in sorted(set(counts[large].calls) | set(counts[small].calls))
                if counts[large].calls[name] != counts[small].calls[name]
            },
        ),
        *launch_figures(args, scratch, micro_batches),
        *(
            figure(
                f"scalar reads per update, {micro} micro-batches",
                reads[micro].scalar_reads,
                "the same at 2 and 8 micro-batches",
                independent,
                shape=f"{scalar_rows} rows x {args.length} tokens, {small} layers",
                sites=dict(reads[micro].scalar_read_sites),
            )
            for micro in (2, 8)
        ),
        figure(
            "FSDP copies per micro-batch at dp = 1",
            copies_per_micro_batch,
            "0",
            copies_per_micro_batch == 0,
            shape=f"{scalar_rows} rows x {args.length} tokens, {small} layers, 2 and 8 micro-batches",
            per_update={micro: copies[micro] for micro in (2, 8)},
            by_op={micro: dict(reads[micro].fsdp_copies) for micro in (2, 8)},
            per_layer_per_mini_batch=slope(lambda c: sum(c.fsdp_copies.values())) * micro_batches,
            note=(
                "what remains is per mini-batch: each unit's gather in the first forward and its gradient's "
                "reduce-scatter in the last backward (actor.unsharded_accumulation_mb)"
            ),
        ),
    ]


def launch_figures(args: argparse.Namespace, scratch: str, micro_batches: int) -> list[dict]:
    """Launches per layer per micro-batch by the profiler (``profiled_launches``), eager and with compiled blocks
    (``model.compile=on``: Inductor's C++ kernels on CPU), the same slope between the two depths."""
    small, large = args.layers
    # Kernel names reach the profiler only from code generated with this flag, so no cached graph may serve.
    torch._inductor.config.cpp.enable_kernel_profile = True
    torch._inductor.config.force_disable_caches = True
    figures = []
    for setting in ("off", "on"):
        launches = {
            layers: profiled_launches(
                os.path.join(scratch, f"l{layers}"),
                rows=args.rows,
                length=args.length,
                micro_batch=args.micro_batch,
                compile_blocks=setting,
            )
            for layers in (small, large)
        }
        per_layer = {
            name: (launches[large][name] - launches[small][name]) / ((large - small) * micro_batches)
            for name in sorted(set(launches[large]) | set(launches[small]))
            if launches[large][name] != launches[small][name]
        }
        value = sum(per_layer.values())
        compiled = setting == "on"
        figures.append(
            figure(
                f"launches per layer per micro-batch, profiler ({'compiled' if compiled else 'eager'})",
                value,
                f"<= {NON_VIEW_GOAL_COMPILED}" if compiled else "none (the eager side of the same count)",
                value <= NON_VIEW_GOAL_COMPILED if compiled else None,
                by_op=per_layer,
                note="non-view ATen ops (no allocation) not inside another op, plus Inductor's kernels; model.compile="
                + setting,
            )
        )
    return figures


def print_table(figures: list[dict]) -> None:
    print(f"{'figure':<58} {'value':>10}  {'goal':<42} meets")
    for row in figures:
        value = "-" if row["value"] is None else f"{row['value']:g}"
        meets = {True: "yes", False: "NO", None: "-"}[row["meets_goal"]]
        print(f"{row['figure']:<58} {value:>10}  {row['goal']:<42} {meets}")
        for key in ("note", "sites", "late_reads"):
            if row.get(key) is not None and row.get(key) != {}:
                print(f"    {key}: {row[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true", help="count the actor's update (the only part so far)")
    parser.add_argument("--layers", type=int, nargs=2, default=[6, 12], help="the two model depths of the slope")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="tokens per row (a quarter prompt)")
    parser.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch of the per-layer counts")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--decode", action="store_true", help="count decode steps (host_overhead_decode.py)")
    add_decode_arguments(parser)
    args = parser.parse_args()
    if args.decode:
        figures = decode_figures(args)
        print_table(figures)
        write_result(
            args.out, "host_overhead_decode", {**decode_result(args, figures), "environment": environment("cpu")}
        )
    if not args.train:
        if not args.decode:
            parser.error("choose what to count: --train and/or --decode")
        return
    with tempfile.TemporaryDirectory() as scratch:
        figures = train_figures(args, scratch)
    print_table(figures)
    write_result(
        args.out,
        "host_overhead_train",
        {
            "benchmark": "host_overhead --train",
            "layers": args.layers,
            "rows": args.rows,
            "length": args.length,
            "micro_batch": args.micro_batch,
            "figures": figures,
            "environment": environment("cpu"),
        },
    )


if __name__ == "__main__":
    main()
