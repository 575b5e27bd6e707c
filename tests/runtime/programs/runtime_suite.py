"""Runtime behaviours on 4 ranks in one job; writes raw observations to JSON for tests/runtime/test_runtime_job.py.

torchrun --nproc-per-node 4 tests/runtime/programs/runtime_suite.py OUT.json
"""

import gc
import json
import sys
import time

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import (
    CallTimeout,
    Coordinator,
    ParallelDims,
    PayloadError,
    ResourcePool,
    Worker,
    all_to_all,
    data_parallel,
    launch,
    one_to_all,
    rank_zero,
)
from spmd_rlhf.runtime.launch import RuntimeOptions, stored_batch_count
from spmd_rlhf.runtime.transfer import traffic

_log: list[tuple[str, int]] = []
COLLECTIVE_TIMEOUT_S = 600.0
"""Not torch's default for gloo groups (30 min): every group a role gets must wait this long at most."""


class Recorder(Worker):
    """Methods that record what each rank saw, so the coordinator can check who ran what, in which order."""

    @one_to_all
    def note(self, index: int) -> int:
        _log.append((self.context.name, index))
        return self.context.rank

    @one_to_all
    def log(self) -> list:
        return [index for name, index in _log if name == self.context.name]

    @all_to_all
    def logs(self) -> list:
        return [index for name, index in _log if name == self.context.name]

    @one_to_all
    def all_reduce(self, value: int) -> int:
        tensor = torch.tensor([value + self.context.rank])
        dist.all_reduce(tensor, group=self.mesh["dp"].get_group())
        return int(tensor.item())

    @one_to_all
    def group_timeouts(self) -> list[float]:
        """Seconds a collective may wait on this role's groups: the role-wide one and its mesh's dp group."""
        groups = (self.context.groups["role"], self.mesh["dp"].get_group())
        return [group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in groups]

    @one_to_all
    def sleep(self, seconds: float) -> float:
        start = time.time()
        time.sleep(seconds)
        return start

    @all_to_all
    def traffic(self) -> dict:
        return traffic()

    @all_to_all
    def offset(self, base: int, step: int) -> tuple:
        return (self.context.rank, base + step)

    @all_to_all
    def last_seen(self) -> list:
        return self.last_ids

    @all_to_all
    def stored(self) -> int:
        return stored_batch_count()

    @rank_zero
    def whoami(self) -> int:
        _log.append((self.context.name, -1))
        return self.context.rank

    @one_to_all
    def big_result(self) -> torch.Tensor:
        return torch.zeros(10_000)

    @data_parallel
    def make(self, rows_per_rank: list[int], width: int, group_size: int = 1) -> Batch:
        """Rows with globally unique ids; DP rank r makes ``rows_per_rank[r]`` rows."""
        rows = rows_per_rank[self.dp_rank]
        first = sum(rows_per_rank[: self.dp_rank])
        ids = torch.arange(first, first + rows)
        return Batch(
            {"id": ids, "payload": ids[:, None].float() * torch.ones(rows, width)},
            {"text": [f"row {i}" for i in ids.tolist()], "info": [{"id": i, "even": i % 2 == 0} for i in ids.tolist()]},
            {"step": 7},
            group_size,
        )

    @data_parallel
    def inspect(self, batch: Batch) -> Batch:
        """Echo the rows with who saw them and what arrived intact."""
        _log.append((self.context.name, -2))
        self.last_ids = batch["id"].tolist()
        rows = len(batch)
        return Batch(
            {
                "id": batch["id"],
                "payload_ok": (batch["payload"] == batch["id"][:, None].float()).all(dim=1),
                "seen_by": torch.full((rows,), self.context.rank),
                "dp_rank": torch.full((rows,), self.dp_rank),
            },
            {"text": list(batch["text"]), "info": list(batch["info"])},
            {"step": batch.meta.get("step"), "group_size_seen": batch.group_size},
            batch.group_size,
        )

    @data_parallel
    def scale(self, batch: Batch, factor: float) -> Batch:
        return Batch({"id": batch["id"], "payload": batch["payload"] * factor}, group_size=batch.group_size)

    @data_parallel
    def summarize(self, batch: Batch) -> dict:
        return {"rows": len(batch), "total": float(batch["payload"].sum())}

    @data_parallel
    def slow_make(self, seconds: float) -> Batch:
        time.sleep(seconds)
        return self.make([4] * self.context.dims.dp, 2)


def observe(coordinator: Coordinator) -> dict:
    results: dict = {}
    everyone = ResourcePool.range(0, 4)
    left, right = ResourcePool([0, 1]), ResourcePool([2, 3])

    errors = {}
    for label, make in {
        "too_many": lambda: coordinator.spawn(Recorder, name="bad", pool=everyone, dims=ParallelDims(dp=3)),
        "beyond_world": lambda: coordinator.spawn(Recorder, name="bad", pool=ResourcePool([2, 3, 4, 5])),
        "local_class": lambda: coordinator.spawn(type("Local", (Worker,), {}), name="bad", pool=everyone),
    }.items():
        try:
            make()
        except (ValueError, TypeError) as error:
            errors[label] = str(error)
    results["spawn_errors"] = errors

    grid = coordinator.spawn(Recorder, name="grid", pool=everyone, dims=ParallelDims(dp=2, tp=2))
    flat = coordinator.spawn(Recorder, name="flat", pool=everyone, dims=ParallelDims(dp=4))
    staged = coordinator.spawn(Recorder, name="staged", pool=everyone, dims=ParallelDims(pp=2, dp=2))
    a = coordinator.spawn(Recorder, name="left", pool=left, dims=ParallelDims(dp=2))
    b = coordinator.spawn(Recorder, name="right", pool=right, dims=ParallelDims(dp=1, tp=2))
    trio = coordinator.spawn(Recorder, name="trio", pool=ResourcePool([1, 2, 3]), dims=ParallelDims(dp=3))

    # Ordering: 100 calls issued without waiting; interleaved collectives of two colocated roles.
    futures = [grid.note(index) for index in range(100)]
    sums = [(flat if index % 2 else grid).all_reduce(index) for index in range(20)]
    results["order"] = grid.logs().result(timeout=60)
    results["note_rank0"] = futures[-1].result(timeout=60)
    results["all_reduce"] = [future.result(timeout=60) for future in sums]

    # A call fed by a slow producer keeps its place in line on the consumer ranks.
    produced = a.slow_make(0.5)
    consumed = b.inspect(produced)
    later = b.note(1000)
    results["deferred_order"] = b.log().result(timeout=60)
    results["deferred_rows"] = coordinator.fetch(consumed).tensors["id"].tolist()
    later.result(timeout=60)

    # Overlap: two 1 s sleeps on disjoint pools.
    start = time.time()
    sleeps = [a.sleep(1.0), b.sleep(1.0)]
    for future in sleeps:
        future.result(timeout=60)
    results["overlap_seconds"] = time.time() - start

    # A wait that runs past its timeout raises, and does not poison the job.
    slow = a.sleep(2.0)
    try:
        slow.result(timeout=0.2)
        results["timeout_error"] = None
    except CallTimeout as error:
        results["timeout_error"] = str(error)
    slow.result(timeout=60)

    # Dispatch modes.
    results["one_to_all"] = grid.note(-5).result(timeout=60)
    results["group_timeouts"] = grid.group_timeouts().result(timeout=60)
    results["all_to_all"] = grid.offset([10, 20, 30, 40], step=[1, 2, 3, 4]).result(timeout=60)
    results["rank_zero"] = b.whoami().result(timeout=60)
    results["rank_zero_log"] = b.logs().result(timeout=60)
    for label, role in {"grid": grid, "staged": staged, "trio": trio}.items():
        made = flat.make([3, 1, 4, 2], 5)
        seen = role.inspect(made)
        ref = seen.result(timeout=60)
        fetched = coordinator.fetch(seen)
        results[f"dp_{label}"] = {
            "owners": [shard.owner for shard in ref.shards],
            "rows": [shard.rows for shard in ref.shards],
            "id": fetched["id"].tolist(),
            "payload_ok": bool(fetched["payload_ok"].all()),
            "seen_by": fetched["seen_by"].tolist(),
            "dp_rank": fetched["dp_rank"].tolist(),
            "text": fetched["text"],
            "info": fetched["info"],
            "meta": fetched.meta,
            "seen_per_rank": role.last_seen().result(timeout=60),
        }
    results["dp_values"] = flat.summarize(flat.make([1, 2, 3, 4], 2)).result(timeout=60)

    # Groups stay whole across a re-layout: 6 groups of 2 from 4 producers onto 3 consumers.
    grouped = trio.inspect(flat.make([4, 2, 4, 2], 3, group_size=2))
    fetched = grouped.result(timeout=60).fetch()
    results["groups"] = {
        "id": fetched["id"].tolist(),
        "dp_rank": fetched["dp_rank"].tolist(),
        "group_size": fetched.group_size,
        "meta": fetched.meta,
    }

    # Colocated with the same DP layout: nothing moves on the data plane.
    before = flat.traffic().result(timeout=60)
    colocated = flat.inspect(flat.make([2, 2, 2, 2], 1000))
    colocated.result(timeout=60)
    after = flat.traffic().result(timeout=60)
    results["colocated_traffic"] = sum(x["sent"] for x in after) - sum(x["sent"] for x in before)

    # A coordinator batch goes in through put.
    prompts = Batch(
        {"id": torch.arange(6), "payload": torch.arange(6)[:, None].float().expand(6, 2).clone()},
        {"text": [f"row {i}" for i in range(6)], "info": [{"id": i, "even": i % 2 == 0} for i in range(6)]},
    )
    results["put"] = coordinator.fetch(grid.inspect(prompts))["id"].tolist()

    # Three-role chain moving >= 10 MB: the coordinator sends and receives only control messages.
    sent, received = coordinator.bytes_sent, coordinator.bytes_received
    moved_before = sum(x["sent"] for x in flat.traffic().result(timeout=60))
    made = a.make([2048, 2048], 640)
    scaled = b.scale(made, 2.0)
    summary = flat.summarize(scaled).result(timeout=60)
    results["chain"] = {
        "coordinator_bytes": coordinator.bytes_sent - sent + coordinator.bytes_received - received,
        "tensor_bytes": 4096 * 640 * 4 * 2,
        "summary": summary,
        "data_plane_bytes": sum(x["sent"] for x in flat.traffic().result(timeout=60)) - moved_before,
    }

    # Control-plane guards.
    try:
        grid.note(torch.zeros(100_000))
        results["payload_error"] = None
    except PayloadError as error:
        results["payload_error"] = str(error)
    try:
        grid.not_a_method()
        results["method_error"] = None
    except AttributeError as error:
        results["method_error"] = str(error)
    return results


def released(coordinator: Coordinator) -> dict:
    """Results nobody references any more are dropped from the workers' stores."""
    flat = coordinator.spawn(Recorder, name="flat2", pool=ResourcePool.range(0, 4))
    grid = coordinator.spawn(Recorder, name="grid2", pool=ResourcePool.range(0, 4), dims=ParallelDims(dp=2, tp=2))
    gc.collect()
    coordinator.wait_all(timeout=60)
    before = flat.stored().result(timeout=60)
    kept = []
    for _ in range(10):
        made = flat.make([2, 2, 2, 2], 4)
        kept += [made, grid.inspect(made).result(timeout=60)]
    during = flat.stored().result(timeout=60)
    del kept, made
    gc.collect()
    coordinator.wait_all(timeout=60)
    return {"before": before, "during": during, "after": flat.stored().result(timeout=60)}


def main(coordinator: Coordinator) -> None:
    results = observe(coordinator)
    results["released"] = released(coordinator)
    results["bytes_sent"] = coordinator.bytes_sent
    with open(sys.argv[1], "w") as out:
        json.dump(results, out)


if __name__ == "__main__":
    launch(main, options=RuntimeOptions(collective_timeout_s=COLLECTIVE_TIMEOUT_S))
