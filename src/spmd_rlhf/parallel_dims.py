"""A role's parallel layout: ``ParallelDims`` (pp x dp x tp over an ordered list of ranks). Plain arithmetic on ranks,
used by the runtime (pools, meshes, dispatch) and by the 3D-HybridEngine (generation layouts) alike.

A role's ranks are laid out as a ``(pp, dp, tp)`` grid in pool order, tp fastest, so tensor-parallel peers are
neighbouring ranks (the same node). Everything here is plain Python so the coordinator can reason about a role's
layout without building its ``DeviceMesh``; only the role's own ranks build the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

MESH_DIM_NAMES = ("pp", "dp", "tp")


class RankList(Protocol):
    """What a layout is checked against: an ordered list of global ranks (``runtime.ResourcePool``)."""

    ranks: tuple[int, ...]

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class Coordinates:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """Parallel sizes of one role: pipeline stages x data-parallel replicas x tensor-parallel shards."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIM_NAMES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r} must be a positive integer")

    @classmethod
    def for_ranks(cls, num_ranks: int, *, pp: int = 1, tp: int = 1, dp: int = 0, role: str = "role") -> ParallelDims:
        """The layout of ``num_ranks`` ranks: dp is what pp x tp leaves (``dp`` given: checked against that). Errors
        name ``<role>.pp`` / ``.tp`` / ``.dp`` and what to change."""
        if num_ranks % (pp * tp):
            raise ValueError(
                f"{role}.pp={pp} x {role}.tp={tp} does not divide the {num_ranks} ranks of its pool; choose sizes "
                f"whose product divides {num_ranks}"
            )
        derived = num_ranks // (pp * tp)
        if dp and dp != derived:
            raise ValueError(
                f"{role}.dp={dp} but its pool of {num_ranks} ranks with pp={pp}, tp={tp} gives dp={derived}; "
                f"set {role}.dp=0"
            )
        return cls(pp=pp, dp=derived, tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check_fits(self, pool: RankList, *, role: str) -> None:
        """Raise a ``ValueError`` naming the role and the fix when the sizes do not cover the pool exactly."""
        if self.world_size != len(pool):
            raise ValueError(
                f"role {role!r}: pp={self.pp} x dp={self.dp} x tp={self.tp} = {self.world_size} ranks, but its pool "
                f"has {len(pool)} ranks {list(pool.ranks)}; choose sizes whose product is {len(pool)}"
            )

    def coordinates(self, role_rank: int) -> Coordinates:
        """(pp, dp, tp) position of the role's ``role_rank``-th rank (pool order, tp fastest)."""
        return Coordinates(
            pp=role_rank // (self.dp * self.tp), dp=(role_rank // self.tp) % self.dp, tp=role_rank % self.tp
        )

    def dp_groups(self, ranks: tuple[int, ...]) -> list[list[int]]:
        """Global ranks of each DP replica (all its pp and tp ranks), indexed by DP rank; they all see the same rows."""
        groups: list[list[int]] = [[] for _ in range(self.dp)]
        for role_rank, rank in enumerate(ranks):
            groups[self.coordinates(role_rank).dp].append(rank)
        return groups

    def stage_ranks(self, ranks: tuple[int, ...], role_rank: int) -> list[int]:
        """Global ranks of the pipeline stages of ``role_rank``'s (dp, tp) position, in stage order (a process
        group numbers its members by ascending global rank, which is stage order only in an ascending pool)."""
        where = self.coordinates(role_rank)
        return [ranks[(stage * self.dp + where.dp) * self.tp + where.tp] for stage in range(self.pp)]

    def result_owners(self, ranks: tuple[int, ...]) -> list[int]:
        """Global rank that keeps each DP replica's result: tp rank 0 of the last pipeline stage."""
        owners = [-1] * self.dp
        for role_rank, rank in enumerate(ranks):
            where = self.coordinates(role_rank)
            if where.tp == 0 and where.pp == self.pp - 1:
                owners[where.dp] = rank
        return owners

    def build_mesh(self, ranks: tuple[int, ...], device_type: str) -> torch.distributed.device_mesh.DeviceMesh:
        """The role's named ``("pp", "dp", "tp")`` mesh. Every global rank must call this in the same order:
        sub-group creation is collective over the world group."""
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.tensor(ranks, dtype=torch.int).reshape(self.pp, self.dp, self.tp)
        return DeviceMesh(device_type, grid, mesh_dim_names=MESH_DIM_NAMES)
