"""A job that spans two torchrun agents (2 x 2 ranks): roles across both "nodes", a transfer, a collective.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        tests/runtime/programs/two_nodes.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import Coordinator, ParallelDims, ResourcePool, Worker, all_to_all, data_parallel, launch


class Node(Worker):
    @all_to_all
    def where(self) -> dict:
        return {
            "rank": self.context.rank,
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "group_rank": int(os.environ["GROUP_RANK"]),
        }

    @data_parallel
    def make(self, rows: int) -> Batch:
        ids = torch.arange(rows) + rows * self.dp_rank
        return Batch({"id": ids, "square": ids * ids}, {"note": [f"from {self.context.rank}"] * rows})

    @data_parallel
    def check(self, batch: Batch) -> dict:
        total = batch["square"].sum().reshape(1)
        dist.all_reduce(total, group=self.mesh["tp"].get_group())
        return {"ids": batch["id"].tolist(), "tp_sum": int(total.item()), "notes": sorted(set(batch["note"]))}


def main(coordinator: Coordinator) -> None:
    # Producer on node 0 (ranks 0, 1); consumer with tp=2 across the node boundary (ranks 1 and 2, 3 and 0).
    producer = coordinator.spawn(Node, name="producer", pool=ResourcePool([0, 1]))
    consumer = coordinator.spawn(Node, name="consumer", pool=ResourcePool([1, 2, 3, 0]), dims=ParallelDims(dp=2, tp=2))
    result = {
        "where": consumer.where().result(timeout=60),
        "check": consumer.check(producer.make(3)).result(timeout=60),
        "world_size": coordinator.world_size,
    }
    with open(sys.argv[1], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    launch(main)
