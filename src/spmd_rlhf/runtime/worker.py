"""What a role's code sees of the runtime: its ``RoleContext`` (mesh, coordinates, device) and the ``Worker`` base.

A role class is constructed on each of its ranks as ``RoleClass(context, *args, **kwargs)``; subclassing ``Worker``
is a convenience, not a requirement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmd_rlhf.parallel_dims import Coordinates, ParallelDims
from spmd_rlhf.runtime.device import check_thread


@dataclass(frozen=True)
class RoleContext:
    name: str
    """The role's name, e.g. ``"actor"``."""
    dims: ParallelDims
    ranks: tuple[int, ...]
    """Global ranks of the role, in pool order."""
    rank: int
    """This process's global rank."""
    mesh: DeviceMesh
    """The role's ``("pp", "dp", "tp")`` mesh; sub-meshes by name, e.g. ``mesh["tp"]``."""
    device: torch.device
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """``"role"``: all the role's ranks; ``"cp"`` with ``dims.cp > 1``: this rank's context-parallel group
    (``ParallelDims.build_context_group``); plus the groups the role class declared with a ``process_groups(dims,
    ranks, *args, **kwargs)`` static method returning ``{name: [ranks of each group]}``: for each name, the group
    this rank belongs to."""
    expert_mesh: DeviceMesh | None = None
    """With ``dims.ep > 1``: the ``("pp", "efsdp", "ep", "tp")`` mesh over the same ranks
    (``ParallelDims.build_expert_mesh``)."""
    hybrid_shard_mesh: DeviceMesh | None = None
    """With ``dims.fsdp_size`` below dp (HSDP): the ``("dp_replicate", "dp_shard")`` mesh
    (``ParallelDims.build_hybrid_shard_mesh``)."""

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards the role's parameters over: ``mesh["dp"]``, or the 2-D HSDP mesh."""
        return self.hybrid_shard_mesh if self.hybrid_shard_mesh is not None else self.mesh["dp"]

    @property
    def role_rank(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def coordinates(self) -> Coordinates:
        return self.dims.coordinates(self.role_rank)


class Worker:
    """Base class for role workers: keeps the context and names its parts."""

    def __init__(self, context: RoleContext) -> None:
        # A role built on a thread that never bound itself to the rank's device would build on cuda:0.
        check_thread(context.device)
        self.context = context

    @property
    def mesh(self) -> DeviceMesh:
        return self.context.mesh

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def dp_rank(self) -> int:
        return self.context.coordinates.dp

    @property
    def tp_rank(self) -> int:
        return self.context.coordinates.tp

    @property
    def pp_rank(self) -> int:
        return self.context.coordinates.pp
