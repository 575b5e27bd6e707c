"""3D-HybridEngine resharding per layout: training -> generation and back, against the all-gather lower bound and the
naive full-weights gather, all measured in the same run on the same ranks.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 4 benchmarks/reshard.py \\
        [--hidden 512] [--layers 8] [--vocab 4096] [--repeats 5] [--layouts dp4tp1pp1:1 dp1tp4pp1:2 ...]

The model is a random-init ``make_tiny`` llama (untied embeddings, so that it splits into pipeline stages) with its
vocabulary widened to ``--vocab``, so that the root block (embedding + head) weighs about as much as a decoder layer.
Each layout ``dp{D}tp{T}pp{P}:{tp_g}`` is an actor spawned on the first D*T*P ranks with ``actor.tp=T``,
``actor.pp=P`` and ``rollout.tp=tp_g``. Per layout, after one warm-up round, ``--repeats`` rounds each time, on every
rank, in turn:

- the bandwidth probe: the engine's flat all-gather over all the actor's ranks, gathering the whole model one
  block-sized message at a time as the engine does (on gloo, messages of a few MB per rank move about twice as fast
  per byte as one message of the whole model);
- training -> generation (``hybrid.generation_model``) and generation -> training (``del`` of that model: the weights
  go by reference counting, which ``measure_memory`` checks; one ``gc.collect()``, which the actor never calls and
  which costs the same whatever was dropped, is timed there and reported apart);
- the naive baseline, ``full_model`` (every rank gathers the full weights; with pp > 1 whole stages are exchanged as
  pickled objects), and dropping it.

A round's time is its slowest rank's; the table gives medians over rounds. The lower bound is the bytes a rank must
receive (its generation shard minus what its training shards already hold of it) at the fastest probe round's
per-rank receive rate, for the rank receiving most. Peak memory (``PeakMemory``: the CUDA allocator's peak on GPU; on
CPU the tensor storages created meanwhile) is measured once per layout, outside the timed rounds since the CPU count
slows every op, and compared with the generation shard + one block (the largest FSDP unit: a decoder layer, or the
root's embedding, norm and head; whole, in the compute dtype) and with one full copy of the weights. Ratios: ours /
bound, naive / ours.

Writes ``benchmarks/results/reshard_<device>_<backend>_<world>.json`` (with every rank's figures and the load average
before and after) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from spmd_rlhf.collectives import all_gather_flat
from spmd_rlhf.config import load_config
from spmd_rlhf.metrics.peak_memory import PeakMemory
from spmd_rlhf.models import DecoderLM, model_from_tensors
from spmd_rlhf.runtime import Coordinator, ParallelDims, ResourcePool, all_to_all, launch
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.workers import ActorWorker

LAYOUTS = [
    "dp4tp1pp1:1",
    "dp2tp2pp1:1",
    "dp2tp2pp1:2",
    "dp1tp4pp1:1",
    "dp1tp4pp1:2",
    "dp1tp4pp1:4",
    "dp2tp1pp2:1",
    "dp1tp2pp2:1",
    "dp1tp2pp2:2",
]
SWITCHES = ("all_gather", "to_generation", "to_training", "naive", "naive_drop")


def local_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of this rank's pieces of ``model``'s parameters (DTensor locals; shared parameters once) in ``dtype``."""
    parameters = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in parameters) * dtype.itemsize


def parse_layout(layout: str) -> tuple[ParallelDims, int]:
    """``"dp2tp2pp1:2"`` -> (training ``ParallelDims``, generation tp)."""
    match = re.fullmatch(r"dp(\d+)tp(\d+)pp(\d+):(\d+)", layout)
    if match is None:
        raise ValueError(f"layout {layout!r}: write it as dp{{D}}tp{{T}}pp{{P}}:{{tp_g}}, e.g. dp2tp2pp1:2")
    dp, tp, pp, tp_g = (int(size) for size in match.groups())
    return ParallelDims(pp=pp, dp=dp, tp=tp), tp_g


class ReshardingActor(ActorWorker):
    """The actor with timed and memory-measured layout switches."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """``model.dtype``: what FSDP gathers in, and what both generation models are built in."""
        return getattr(torch, self.config.model.dtype)

    def _clock(self) -> float:
        """Wall time once this rank's queued device work has finished."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _whole_model_sizes(self) -> tuple[int, int]:
        """(bytes of the whole model, bytes of its largest FSDP block) in the compute dtype."""
        with torch.device("meta"):
            whole = DecoderLM(self.model.module.args, head="lm")
        numels = {name: p.numel() for name, p in whole.named_parameters()}
        layers = [
            sum(n for name, n in numels.items() if name.startswith(f"model.layers.{index}."))
            for index in range(self.model.module.args.num_layers)
        ]
        root = sum(n for name, n in numels.items() if not name.startswith("model.layers."))
        return sum(numels.values()) * self.compute_dtype.itemsize, max(*layers, root) * self.compute_dtype.itemsize

    def full_model(self, dtype: torch.dtype) -> DecoderLM:
        """The naive baseline: a plain ``DecoderLM`` with a copy of the full weights on every rank (every rank of the
        role must call it). FSDP's own unshard gathers each block's parameters in one all-gather and the copies
        outlive the reshard; with pp > 1 the stages are exchanged whole as pickled objects."""
        fsdp_modules = [module for module in self.model.module.modules() if isinstance(module, FSDPModule)]
        for module in fsdp_modules:
            module.unshard()
        tensors = {}
        for name, param in self.model.module.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            tensors[name] = full.detach().to(dtype, copy=True)
        for module in fsdp_modules:
            module.reshard()
        if self.model.pipeline is not None:
            stages: list[dict[str, torch.Tensor] | None] = [None] * self.model.pipeline.num_stages
            dist.all_gather_object(
                stages, {name: tensor.cpu() for name, tensor in tensors.items()}, group=self.model.pp_group
            )
            tensors = {name: tensor.to(self.device) for stage in stages for name, tensor in stage.items()}
        return model_from_tensors(
            self.model.module.args, tensors, head=self.model.module.head, attention_backend=self.config.model.attention
        )

    @all_to_all
    def time_switches(self, repeats: int) -> dict:
        """This rank's seconds for each switch (``SWITCHES``) in each of ``repeats`` rounds after a warm-up round, the
        bytes it received in each round's bandwidth probe, and its device type."""
        dtype, ranks = self.compute_dtype, len(self.context.ranks)
        whole_bytes, block_bytes = self._whole_model_sizes()
        # The whole model, one block-sized message at a time as the engine sends them (see the module docstring).
        probe = torch.ones(block_bytes // dtype.itemsize // ranks, dtype=dtype, device=self.device)
        messages = max(1, whole_bytes // block_bytes)
        gc.collect()  # what earlier layouts left behind, so that no collection falls into a timed stretch
        seconds: dict[str, list[float]] = {switch: [] for switch in SWITCHES}
        for _ in range(repeats + 1):
            dist.barrier(group=self.model.role_group)
            start = self._clock()
            for _ in range(messages):
                all_gather_flat(probe.new_empty(ranks * probe.numel()), probe, group=self.model.role_group)
            seconds["all_gather"].append(self._clock() - start)
            for build, build_key, drop_key in (
                (self.hybrid.generation_model, "to_generation", "to_training"),
                (self.full_model, "naive", "naive_drop"),
            ):
                dist.barrier(group=self.model.role_group)
                start = self._clock()
                model = build(dtype)
                built = self._clock()
                del model
                seconds[build_key].append(built - start)
                seconds[drop_key].append(self._clock() - built)
        return {
            "seconds": {switch: values[1:] for switch, values in seconds.items()},
            "probe_received_bytes": messages * (ranks - 1) * probe.nbytes,
            "device": self.device.type,
        }

    @all_to_all
    def measure_memory(self, _: None) -> dict[str, int | float | bool]:
        """This rank's peak memory increase while building the generation model and the naive full copy, the sizes
        they are compared with, whether dropping each model freed it with no garbage collection, and what one
        ``gc.collect()`` costs here (the actor never calls it)."""
        dtype = self.compute_dtype
        with PeakMemory(self.device) as ours:
            model = self.hybrid.generation_model(dtype)
        shard_bytes = local_bytes(model, dtype)
        generation_model = weakref.ref(model)
        del model
        with PeakMemory(self.device) as naive:
            model = self.full_model(dtype)
        full_model = weakref.ref(model)
        del model
        freed_by_refcount = generation_model() is None and full_model() is None
        start = time.perf_counter()
        gc.collect()
        gc_collect_s = time.perf_counter() - start
        whole_bytes, block_bytes = self._whole_model_sizes()
        return {
            "peak_increase": ours.peak_increase,
            "naive_peak_increase": naive.peak_increase,
            "generation_shard_bytes": shard_bytes,
            "held_bytes": local_bytes(self.model.module, dtype),
            "whole_model_bytes": whole_bytes,
            "block_bytes": block_bytes,
            "freed_by_refcount": freed_by_refcount,
            "gc_collect_s": gc_collect_s,
        }


def make_model(out_dir: str, *, hidden: int, layers: int, vocab: int) -> str:
    """A ``make_tiny`` llama (whose tokenizer tops out at a few hundred tokens) with its vocabulary widened to
    ``vocab``."""
    make_tiny(family="llama", out_dir=out_dir, hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4)
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(out_dir)
    return out_dir


def summarize(timings: list[dict], memory: list[dict]) -> dict:
    """One layout's row from every rank's ``time_switches`` and ``measure_memory``: per switch, the median over
    rounds of the slowest rank's time; the bounds and ratios."""
    slowest = {
        switch: [max(per_rank) for per_rank in zip(*(rank["seconds"][switch] for rank in timings))]
        for switch in SWITCHES
    }
    median = {switch: statistics.median(rounds) for switch, rounds in slowest.items()}
    whole_bytes, block_bytes = memory[0]["whole_model_bytes"], memory[0]["block_bytes"]
    # A bound: the bytes cannot arrive faster than the fastest probe round moved them.
    bandwidth = timings[0]["probe_received_bytes"] / min(slowest["all_gather"])
    must_receive = max(rank["generation_shard_bytes"] - rank["held_bytes"] for rank in memory)
    shard_bytes = max(rank["generation_shard_bytes"] for rank in memory)
    peak = max(rank["peak_increase"] for rank in memory)
    naive_peak = max(rank["naive_peak_increase"] for rank in memory)
    bound_s = must_receive / bandwidth
    return {
        "seconds": median,
        "all_gather_bytes_per_s": bandwidth,
        "must_receive_bytes": must_receive,
        "bound_s": bound_s,
        "ratio_to_bound": median["to_generation"] / bound_s if bound_s else None,
        "naive_ratio": median["naive"] / median["to_generation"],
        "peak_increase": peak,
        "generation_shard_bytes": shard_bytes,
        "block_bytes": block_bytes,
        "whole_model_bytes": whole_bytes,
        "peak_to_shard_plus_block": peak / (shard_bytes + block_bytes),
        "peak_to_whole_model": peak / whole_bytes,
        "naive_peak_increase": naive_peak,
        "naive_peak_ratio": naive_peak / peak,
        "freed_by_refcount": all(rank["freed_by_refcount"] for rank in memory),
        "gc_collect_s": max(rank["gc_collect_s"] for rank in memory),
        "per_rank": {"timings": timings, "memory": memory},
    }


def table(results: dict[str, dict]) -> str:
    """A markdown table, one row per layout."""
    megabytes = lambda count: f"{count / 2**20:.1f}"
    lines = [
        "| layout | train→gen s | gen→train s | must receive MB | bound s | ours / bound | naive s | naive / ours "
        "| peak MB | peak / (shard + block) | peak / full copy | naive peak / ours |",
        "|" + " --- |" * 12,
    ]
    for layout, row in results.items():
        seconds = row["seconds"]
        ratio = "—" if row["ratio_to_bound"] is None else f"{row['ratio_to_bound']:.2f}"
        lines.append(
            f"| {layout} | {seconds['to_generation']:.3f} | {seconds['to_training']:.3f} "
            f"| {megabytes(row['must_receive_bytes'])} | {row['bound_s']:.3f} | {ratio} | {seconds['naive']:.3f} "
            f"| {row['naive_ratio']:.2f} | {megabytes(row['peak_increase'])} | {row['peak_to_shard_plus_block']:.2f} "
            f"| {row['peak_to_whole_model']:.2f} | {row['naive_peak_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(coordinator: Coordinator, args: argparse.Namespace) -> None:
    """Measure every layout in ``args.layouts`` on the first ranks of the job; print the table and write the JSON."""
    results: dict[str, dict] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as model_dir:
        make_model(model_dir, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
        for layout in args.layouts:
            dims, tp_g = parse_layout(layout)
            config = load_config(
                None,
                [
                    f"model.path={model_dir}",
                    f"model.dtype={args.dtype}",
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
            results[layout] = summarize(timings, memory)
            seconds = results[layout]["seconds"]
            print(
                f"{layout}: train -> gen {seconds['to_generation']:.3f} s, naive {seconds['naive']:.3f} s", flush=True
            )
            device = timings[0]["device"]
    backend = "nccl" if device == "cuda" else "gloo"
    world = coordinator.world_size
    print(
        f"\nreshard benchmark: {world} ranks, {device}/{backend}, llama hidden {args.hidden} x {args.layers} layers, "
        f"vocab {args.vocab}, {args.dtype}, torch {torch.__version__}, medians of {args.repeats} rounds"
    )
    print(table(results))
    collect = [row["gc_collect_s"] for row in results.values()]
    freed = all(row["freed_by_refcount"] for row in results.values())
    print(
        f"every dropped model freed by reference counting alone: {freed}; one gc.collect() (not part of any switch): "
        f"{min(collect):.3f}-{max(collect):.3f} s"
    )
    report = {
        "results": results,
        "environment": {
            "torch": torch.__version__,
            "device": device,
            "backend": backend,
            "world_size": world,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "command": f"torch.distributed.run --nproc-per-node {world} benchmarks/reshard.py",
            "model": {
                "family": "llama",
                "hidden": args.hidden,
                "layers": args.layers,
                "vocab": args.vocab,
                "dtype": args.dtype,
            },
            "repeats": args.repeats,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0],
        },
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"reshard_{device}_{backend}_{world}.json")
    with open(path, "w") as out:
        json.dump(report, out, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=LAYOUTS)
    parser.add_argument("--out", default="benchmarks/results")
    arguments = parser.parse_args()
    launch(lambda coordinator: main(coordinator, arguments))
