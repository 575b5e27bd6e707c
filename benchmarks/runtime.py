"""Runtime overheads: empty-call latency, transfer throughput against raw point-to-point, coordinator bytes per call.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/runtime.py [--calls 200] [--megabytes 64]

- Latency: an empty data-parallel call (no batch in, nothing out) issued and waited one at a time, on roles of
  1, 2 and 4 ranks (rank 0 alone is a local call with no RPC); median and p99.
- Transfer: a batch made by a role on ranks 0-1 consumed by a role on ranks 2-3 (rank 0 -> 2 and 1 -> 3 in parallel),
  against raw ``send``/``recv`` of the same bytes between the same pairs, in the same job. Ratio = ours / raw time.
- Coordinator bytes: what rank 0 sent and received on the control plane for each kind of call.

Writes ``benchmarks/results/runtime_<device>_<backend>_<world>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import Coordinator, ResourcePool, Worker, data_parallel, launch, one_to_all


class Bench(Worker):
    @data_parallel
    def empty(self) -> None:
        return None

    @data_parallel
    def make(self, floats_per_rank: int) -> Batch:
        rows = 64
        return Batch({"payload": torch.ones(rows, floats_per_rank // rows, device=self.device)})

    @data_parallel
    def consume(self, batch: Batch) -> int:
        return len(batch)

    @one_to_all
    def raw_transfer(self, floats_per_rank: int, repeats: int, fresh: bool) -> float:
        """Seconds per transfer of the same bytes with plain send/recv between ranks (0, 2) and (1, 3), receiving
        into one reused buffer (the link's floor) or into a new one each time (what keeping the data costs)."""
        rank = self.context.rank
        buffer = torch.ones(64, floats_per_rank // 64, device=self.device)
        peer = rank + 2 if rank < 2 else rank - 2
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            if rank < 2:
                dist.send(buffer, peer)
            else:
                dist.recv(torch.empty_like(buffer) if fresh else buffer, peer)
        dist.barrier()
        return (time.perf_counter() - start) / repeats


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main(coordinator: Coordinator, args: argparse.Namespace) -> dict:
    world = coordinator.world_size
    results: dict = {"latency": {}, "transfer": {}, "coordinator_bytes": {}}
    sizes = [size for size in (1, 2, 4) if size <= world]
    for size in sizes:
        role = coordinator.spawn(Bench, name=f"bench{size}", pool=ResourcePool.range(0, size))
        role.ready.result(timeout=120)
        for _ in range(10):
            role.empty().result(timeout=60)
        seconds = []
        sent, received = coordinator.bytes_sent, coordinator.bytes_received
        for _ in range(args.calls):
            start = time.perf_counter()
            role.empty().result(timeout=60)
            seconds.append(time.perf_counter() - start)
        results["latency"][size] = {
            "median_ms": 1e3 * statistics.median(seconds),
            "p99_ms": 1e3 * _percentile(seconds, 0.99),
        }
        results["coordinator_bytes"][f"empty call, {size} rank(s)"] = (
            coordinator.bytes_sent - sent + coordinator.bytes_received - received
        ) / args.calls
    if world >= 4:
        producer = coordinator.spawn(Bench, name="producer", pool=ResourcePool([0, 1]))
        consumer = coordinator.spawn(Bench, name="consumer", pool=ResourcePool([2, 3]))
        everyone = coordinator.spawn(Bench, name="everyone", pool=ResourcePool.range(0, 4))
        floats_per_rank = args.megabytes * 2**20 // 4 // 2
        made = producer.make(floats_per_rank).result(timeout=120)
        consumer.consume(made).result(timeout=120)
        repeats = args.transfer_repeats
        sent, received = coordinator.bytes_sent, coordinator.bytes_received
        start = time.perf_counter()
        for _ in range(repeats):
            consumer.consume(made).result(timeout=120)
        ours = (time.perf_counter() - start) / repeats
        calls_bytes = coordinator.bytes_sent - sent + coordinator.bytes_received - received
        reused = everyone.raw_transfer(floats_per_rank, repeats, False).result(timeout=300)
        fresh = everyone.raw_transfer(floats_per_rank, repeats, True).result(timeout=300)
        results["transfer"] = {
            "megabytes": args.megabytes,
            "ours_s": ours,
            "raw_reused_buffer_s": reused,
            "raw_fresh_buffer_s": fresh,
            "ratio_to_fresh": ours / fresh,
            "ratio_to_reused": ours / reused,
        }
        results["coordinator_bytes"][f"{args.megabytes} MB transfer call"] = calls_bytes / repeats
    return results


def _report(results: dict, args: argparse.Namespace, world: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    print(f"\nruntime benchmark: {world} ranks, {device}/{backend}, torch {torch.__version__}")
    print("| measure | value |\n| --- | --- |")
    for size, latency in results["latency"].items():
        print(
            f"| empty data-parallel call, {size} rank(s) "
            f"| median {latency['median_ms']:.2f} ms, p99 {latency['p99_ms']:.2f} ms |"
        )
    if results["transfer"]:
        t = results["transfer"]
        rate = lambda seconds: f"{seconds * 1e3:.1f} ms ({t['megabytes'] / 1024 / seconds:.2f} GB/s)"
        print(f"| {t['megabytes']} MB, ranks 0-1 -> 2-3 as a BatchRef input | {rate(t['ours_s'])} |")
        print(f"| same bytes, raw send/recv into new buffers | {rate(t['raw_fresh_buffer_s'])} |")
        print(f"| same bytes, raw send/recv into one reused buffer | {rate(t['raw_reused_buffer_s'])} |")
        print(f"| ratio ours / raw (new buffers; reused) | {t['ratio_to_fresh']:.2f}; {t['ratio_to_reused']:.2f} |")
    for what, count in results["coordinator_bytes"].items():
        print(f"| coordinator bytes per call: {what} | {count:.0f} |")
    results["environment"] = {
        "torch": torch.__version__,
        "device": device,
        "backend": backend,
        "world_size": world,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "command": f"torchrun --nproc-per-node {world} benchmarks/runtime.py",
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"runtime_{device}_{backend}_{world}.json")
    with open(path, "w") as out:
        json.dump(results, out, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--transfer-repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    arguments = parser.parse_args()

    def run(coordinator: Coordinator) -> None:
        _report(main(coordinator, arguments), arguments, coordinator.world_size)

    launch(run)
