"""Rank 2 raises inside a method while the other ranks wait in a collective for it; the job must end with one error.

torchrun --nproc-per-node 4 tests/runtime/programs/worker_raises.py
"""

import torch
import torch.distributed as dist

from spmd_rlhf.runtime import Coordinator, ResourcePool, Worker, launch, one_to_all


class Fragile(Worker):
    @one_to_all
    def reduce_rows(self) -> int:
        if self.context.rank == 2:
            raise ValueError("bad row 17")
        total = torch.ones(1)
        dist.all_reduce(total, group=self.mesh["dp"].get_group())
        return int(total.item())


def main(coordinator: Coordinator) -> None:
    role = coordinator.spawn(Fragile, name="fragile", pool=ResourcePool.range(0, 4))
    role.reduce_rows().result(timeout=120)
    print("NOT REACHED: the call should have failed", flush=True)


if __name__ == "__main__":
    launch(main)
