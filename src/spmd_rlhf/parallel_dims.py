"""A role's parallel layout: ``ParallelDims`` (pp x dp x tp over an ordered list of ranks). Plain arithmetic on ranks,
used by the runtime (pools, meshes, dispatch) and by the 3D-HybridEngine (generation layouts) alike.

A role's ranks are laid out as a ``(pp, dp, tp)`` grid in pool order, tp fastest, so tensor-parallel peers are
neighbouring ranks (the same node). Expert parallelism borrows from dp, as TorchTitan's does: ``ep`` divides dp, and
a mixture-of-experts layer's experts are split over the ``ep`` consecutive DP ranks of a group (``dp = efsdp x ep``,
ep fastest) and FSDP-sharded over the ``efsdp`` groups; everything else is FSDP-sharded over all of dp. Context
parallelism borrows from dp too: the ``cp`` consecutive DP ranks of a group keep their own rows (as DP ranks) and run
every micro-batch of the group together, each a chunk of its packed row (``training.context_parallel``). Hybrid
sharding (HSDP) groups dp too: with ``fsdp_size`` set, FSDP shards over the ``fsdp_size`` consecutive DP ranks of a
group (the same node when ``fsdp_size x tp`` fits one) and the ``dp / fsdp_size`` groups hold replicas: each unit is
gathered within its group, and its gradient reduce-scattered within the group and all-reduced across groups.
Everything here is plain Python so the coordinator can reason about a role's layout without building its
``DeviceMesh``; only the role's own ranks build the mesh.
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
    ep: int = 1
    """Expert-parallel degree, a divisor of dp (not a factor of the world size: it splits the DP ranks)."""
    cp: int = 1
    """Context-parallel degree, a divisor of dp (like ep, it groups DP ranks)."""
    fsdp_size: int = 0
    """FSDP's shard group: 0 shards over all of dp; a divisor of dp shards over that many consecutive DP ranks and
    replicates over the ``dp / fsdp_size`` groups (HSDP)."""

    def __post_init__(self) -> None:
        for name in (*MESH_DIM_NAMES, "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name}={value!r} must be a positive integer")
        for name in ("ep", "cp"):
            if self.dp % getattr(self, name):
                raise ValueError(f"ParallelDims.{name}={getattr(self, name)} must divide dp={self.dp} (it splits dp)")
        if not isinstance(self.fsdp_size, int) or self.fsdp_size < 0 or (self.fsdp_size and self.dp % self.fsdp_size):
            raise ValueError(f"ParallelDims.fsdp_size={self.fsdp_size!r} must be 0 or a divisor of dp={self.dp}")

    @classmethod
    def for_ranks(
        cls,
        num_ranks: int,
        *,
        pp: int = 1,
        tp: int = 1,
        dp: int = 0,
        ep: int = 1,
        cp: int = 1,
        fsdp_size: int = 0,
        role: str = "role",
    ) -> ParallelDims:
        """The layout of ``num_ranks`` ranks: dp is what pp x tp leaves (``dp`` given: checked against that), split
        into ``ep`` expert-parallel ranks, ``cp`` context-parallel ones and FSDP groups of ``fsdp_size``. Errors
        name ``<role>.pp`` / ``.tp`` / ``.dp`` / ``.ep`` / ``.cp`` / ``.fsdp_size`` and what to change."""
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
        for name, size in (("ep", ep), ("cp", cp), ("fsdp_size", fsdp_size or derived)):
            if derived % size:
                raise ValueError(
                    f"{role}.{name}={size} does not divide its dp={derived} ({num_ranks} ranks / (pp={pp} x tp={tp})): "
                    f"it splits the data-parallel ranks; set {role}.{name} to a divisor of {derived}"
                )
        return cls(pp=pp, dp=derived, tp=tp, ep=ep, cp=cp, fsdp_size=0 if fsdp_size == derived else fsdp_size)

    @property
    def efsdp(self) -> int:
        """The DP ranks that hold the same experts, over which FSDP shards them: ``dp / ep``."""
        return self.dp // self.ep

    @property
    def fsdp_shards(self) -> int:
        """The DP ranks FSDP shards each parameter over: ``fsdp_size``, or all of dp."""
        return self.fsdp_size or self.dp

    @property
    def fsdp_replicas(self) -> int:
        """The groups of ``fsdp_shards`` DP ranks that each hold a whole sharded copy (1 without HSDP)."""
        return self.dp // self.fsdp_shards

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

    def build_expert_mesh(
        self, mesh: torch.distributed.device_mesh.DeviceMesh
    ) -> torch.distributed.device_mesh.DeviceMesh | None:
        """With ``ep > 1``, the role's ``mesh`` with dp unflattened into ``("efsdp", "ep")`` (ep fastest: the same
        ranks, dp order unchanged): a ``("pp", "efsdp", "ep", "tp")`` mesh sharing ``mesh``'s root, which FSDP needs
        to shard the experts' ep-sharded DTensors over efsdp; None with ``ep = 1``. Collective like ``build_mesh``."""
        if self.ep == 1:
            return None
        return _unflatten_dp(mesh, (self.efsdp, self.ep), ("efsdp", "ep"))

    def build_hybrid_shard_mesh(
        self, mesh: torch.distributed.device_mesh.DeviceMesh
    ) -> torch.distributed.device_mesh.DeviceMesh | None:
        """With HSDP (``fsdp_replicas > 1``), the role's ``mesh`` with dp unflattened into ``("dp_replicate",
        "dp_shard")`` (shard fastest: the same ranks, dp order unchanged), sliced to those two dimensions: the 2-D
        mesh FSDP2 takes for hybrid sharding, sharing ``mesh``'s root as TP's mesh does; None otherwise. Collective
        like ``build_mesh``."""
        if self.fsdp_replicas == 1:
            return None
        view = _unflatten_dp(mesh, (self.fsdp_replicas, self.fsdp_shards), ("dp_replicate", "dp_shard"))
        return view["dp_replicate", "dp_shard"]

    def build_context_group(
        self, mesh: torch.distributed.device_mesh.DeviceMesh
    ) -> torch.distributed.ProcessGroup | None:
        """With ``cp > 1``, this rank's context-parallel group: the ``cp`` consecutive DP ranks (same pp and tp) that
        run each other's micro-batches together; None with ``cp = 1``. Collective like ``build_mesh``."""
        if self.cp == 1:
            return None
        view = _unflatten_dp(mesh, (self.dp // self.cp, self.cp), ("dp_outer", "cp"))
        return view["cp"].get_group() if mesh.get_coordinate() is not None else None


def _unflatten_dp(
    mesh: torch.distributed.device_mesh.DeviceMesh, sizes: tuple[int, int], names: tuple[str, str]
) -> torch.distributed.device_mesh.DeviceMesh:
    """``mesh`` with its dp dimension unflattened into ``names`` of ``sizes``. The dimension goes by its index:
    torch 2.11's ``_unflatten`` refuses every name its mesh has (its check is inverted; 2.13 takes either)."""
    return mesh._unflatten(mesh.mesh_dim_names.index("dp"), sizes, names)
