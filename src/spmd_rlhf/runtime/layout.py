"""Where roles run: ``ResourcePool``, an ordered list of global ranks. A role's layout on its pool is a
``spmd_rlhf.parallel_dims.ParallelDims``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ResourcePool:
    """An ordered set of global ranks. Roles spawned on the same pool share its processes (colocation)."""

    ranks: tuple[int, ...]

    def __init__(self, ranks: Iterable[int]) -> None:
        ranks = tuple(int(rank) for rank in ranks)
        if not ranks:
            raise ValueError("a ResourcePool needs at least one rank")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ResourcePool ranks {list(ranks)} repeat a rank")
        if min(ranks) < 0:
            raise ValueError(f"ResourcePool ranks {list(ranks)} include a negative rank")
        object.__setattr__(self, "ranks", ranks)

    @classmethod
    def range(cls, start: int, stop: int) -> ResourcePool:
        return cls(range(start, stop))

    def __len__(self) -> int:
        return len(self.ranks)

    def overlaps(self, other: ResourcePool) -> bool:
        return bool(set(self.ranks) & set(other.ranks))
