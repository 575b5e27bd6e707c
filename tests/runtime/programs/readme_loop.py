"""The controller loop shown in the README (kept here so a test runs it): torchrun --nproc-per-node 4 readme_loop.py"""

import torch

from spmd_rlhf.data import Batch
from spmd_rlhf.runtime import Coordinator, ParallelDims, ResourcePool, Worker, data_parallel, launch


class Scorer(Worker):
    def __init__(self, context, scale: float):
        super().__init__(context)
        self.scale = scale

    @data_parallel
    def score(self, batch: Batch) -> Batch:  # on every rank, with its replica's rows
        return Batch({"x": batch["x"], "score": batch["x"].float() * self.scale})


class Summer(Worker):
    @data_parallel
    def total(self, batch: Batch) -> float:
        return float(batch["score"].sum())


def main(coordinator: Coordinator) -> None:  # rank 0's main thread; every rank (0 too) also serves as a worker
    scorer = coordinator.spawn(Scorer, 2.0, name="scorer", pool=ResourcePool([0, 1]), dims=ParallelDims(tp=2))
    summer = coordinator.spawn(Summer, name="summer", pool=ResourcePool([2, 3]))
    scores = scorer.score(Batch({"x": torch.arange(8)}))  # a future at once
    print(summer.total(scores).result())  # rows go rank 0 -> ranks 2, 3 directly: [12.0, 44.0]
    print(scores.result().fetch()["score"])  # bring data to the coordinator only when asked
    print(coordinator.bytes_sent, coordinator.bytes_received)


if __name__ == "__main__":
    launch(main)
