"""How the rows of one DP shard of prompts are spread over generation replicas: ``Replicas``, which
``workers.generation.Generator`` asks which rows this rank answers and through which it gathers the others'; the
actor's HybridEngine (``hybrid.HybridEngine``, its micro-DP) and the rollout role (``OneReplica``) answer it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class Replicas(Protocol):
    """How the rows of one DP shard are spread over generation replicas (``hybrid.HybridEngine`` implements it)."""

    def replica_rows(self, num_rows: int) -> torch.Tensor: ...

    def gather_rows(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def sum_over_replicas(self, value: float) -> float: ...

    def on_replica_leader(self, compute: Callable[[], T]) -> T: ...


class OneReplica:
    """A DP shard answered by one replica (the rollout role: each DP group of ``tp_group``'s ranks is a replica of its
    own)."""

    def __init__(self, tp_group: dist.ProcessGroup | None = None) -> None:
        self.tp_group = tp_group
        """The replica's tensor-parallel ranks (None: one rank), which must agree on a multi-turn environment's
        answers."""

    def replica_rows(self, num_rows: int) -> torch.Tensor:
        return torch.arange(num_rows)

    def gather_rows(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors

    def sum_over_replicas(self, value: float) -> float:
        return float(value)

    def on_replica_leader(self, compute: Callable[[], T]) -> T:
        """``compute()`` on the replica's first rank, its result on every rank of the replica."""
        if self.tp_group is None:
            return compute()
        leader = dist.get_global_rank(self.tp_group, 0)
        box = [compute() if dist.get_rank() == leader else None]
        dist.broadcast_object_list(box, src=leader, group=self.tp_group)
        return box[0]
