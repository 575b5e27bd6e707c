"""Reductions over a role's DP group: the statistics of a whole batch from the DP shards that hold it.

A ``DPReducer`` is what the parts of a role (its sharded model, its ``Trainer``, the advantage estimators) need of the
role's data parallelism, and nothing else: sums and maxima over the DP ranks, and the check that every
DP rank got as many rows as every other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from spmd_rlhf.collectives import all_gather_flat
from spmd_rlhf.data.batch import Batch


class DPReducer:
    """Collectives over the DP group ``group`` of the role ``role`` (named in error messages)."""

    def __init__(self, group: dist.ProcessGroup, *, role: str) -> None:
        self.group = group
        self.size = group.size()
        self.role = role

    def reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """``tensor`` reduced elementwise over the DP ranks (a new tensor; gloo and NCCL alike)."""
        total = tensor.detach().clone()
        if self.size > 1:
            dist.all_reduce(total, op=op, group=self.group)
        return total

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.reduce(tensor)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.reduce(tensor, dist.ReduceOp.MAX)

    def totals(self, sums: list[float], maxima: list[float] = ()) -> tuple[list[float], list[float]]:
        """``sums`` summed and ``maxima`` maximized over the DP ranks in one collective (every rank gives the same
        number of each): a call's metrics cost one latency, not one per statistic. A minimum is the maximum of the
        negated value."""
        local = torch.tensor([*sums, *maxima], dtype=torch.float64)
        if self.size > 1:
            gathered = local.new_empty(self.size * len(local))
            all_gather_flat(gathered, local, group=self.group)
            by_rank = gathered.view(self.size, len(local))
            local = torch.cat([by_rank[:, : len(sums)].sum(dim=0), by_rank[:, len(sums) :].amax(dim=0)])
        values = local.tolist()
        return values[: len(sums)], values[len(sums) :]

    def gather_objects(self, value: Any) -> list[Any]:
        """Every DP rank's ``value`` (picklable), in DP-rank order."""
        if self.size == 1:
            return [value]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def check_equal_shards(self, batch: Batch, method: str) -> None:
        """FSDP runs a collective per forward, so every DP rank must run the same number of micro-batches."""
        most, negated_fewest = map(int, self.max(torch.tensor([len(batch), -len(batch)], dtype=torch.float64)).tolist())
        if most != -negated_fewest:
            raise ValueError(
                f"{self.role}.{method}: DP ranks got between {-negated_fewest} and {most} rows; make the "
                f"batch (data.batch_size x rollout.n responses) divide evenly over {self.size} DP ranks"
            )
