"""The trainer's weights sent to the rollout role's replicas, mesh to mesh.

The actor trains with FSDP x TP DTensors on its mesh; the rollout generates with TP-sharded weights (one copy per
replica) on another mesh over other ranks. DTensor cannot redistribute from one mesh to another, so the sync is a
broadcast over the ``weight_sync`` group (the actor's first rank and every rollout rank):

  1. every actor rank takes part in each parameter's ``full_tensor()`` (one all-gather over the actor's mesh, one
     parameter at a time); the actor's first rank casts it to the rollout's dtype and packs it into the bucket;
  2. a full bucket (``rollout.sync_bucket_mb``; a larger tensor is a bucket of its own) is broadcast to the rollout
     ranks, each of which copies its TP shard of every tensor in it (``torch.chunk`` along the shard dimension, as
     DTensor's ``Shard`` cuts) into its generation model.

Both sides derive the same bucket plan from the parameters' names and global shapes, and check it first: a model that
differs on the two sides fails at once on both, naming them. Every wait is bounded by ``timeout_s`` and a failure
names the version, both sides' ranks and the bucket. The rollout's weights then equal the trainer's cast to its
dtype, bit for bit.

Peak per rank: actor ranks one full parameter (the first rank also one bucket); rollout ranks their generation shard
plus one bucket.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class SyncSides:
    """Who takes part: the sending actor rank, the receiving rollout ranks, and the group spanning them."""

    source: int
    """Global rank of the actor's first rank, the one that broadcasts."""
    rollout_ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    """The ``weight_sync`` group; None on the actor ranks outside it."""
    timeout_s: float

    def describe(self, version: int) -> str:
        return (f"weight sync of policy version {version} from actor rank {self.source} to rollout ranks "
                f"{list(self.rollout_ranks)}")


def sync_group_ranks(actor_ranks: tuple[int, ...], rollout_ranks: tuple[int, ...]) -> list[int]:
    """The ranks of the ``weight_sync`` group: the actor's first rank, then the rollout's."""
    return [actor_ranks[0], *rollout_ranks]


def bucket_plan(shapes: list[tuple[str, tuple[int, ...]]], *, element_bytes: int, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``shapes`` in each bucket, in order: consecutive tensors while they fit ``bucket_bytes``; a tensor
    larger than that is a bucket of its own."""
    buckets: list[list[int]] = []
    filled = bucket_bytes  # forces a first bucket
    for index, (_, shape) in enumerate(shapes):
        size = element_bytes * _numel(shape)
        if filled + size > bucket_bytes or not buckets:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _fingerprint(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> int:
    return zlib.crc32(json.dumps([shapes, str(dtype)]).encode())


def _wait(work: dist.Work, sides: SyncSides, version: int, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=sides.timeout_s))
    except Exception as error:
        raise RuntimeError(
            f"{sides.describe(version)}: {what} did not complete within {sides.timeout_s:g} s "
            f"(trainer.collective_timeout_s): {error}"
        ) from error


def _plans_differ(fingerprint: int, sides: SyncSides, version: int, *, sender: bool) -> bool:
    """Whether any rollout rank's bucket plan differs from the sender's: everyone in the group learns it before any
    weight moves."""
    theirs = torch.tensor([fingerprint], dtype=torch.int64)
    _wait(dist.broadcast(theirs, src=sides.source, group=sides.group, async_op=True), sides, version, "the plan check")
    mismatch = torch.tensor([0 if sender else int(int(theirs) != fingerprint)], dtype=torch.int64)
    work = dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=sides.group, async_op=True)
    _wait(work, sides, version, "the plan check")
    return bool(int(mismatch))


def _mismatch(sides: SyncSides, version: int) -> RuntimeError:
    return RuntimeError(
        f"{sides.describe(version)}: the two sides' models differ (parameter names, shapes or rollout dtype); the "
        f"rollout must build the actor's model: check actor.model_path / model.path and model.dtype"
    )


def _global_shapes(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(param.shape)) for name, param in named]


@torch.no_grad()
def send_weights(
    model: torch.nn.Module, *, sides: SyncSides, rank: int, trainer_group: dist.ProcessGroup, dtype: torch.dtype,
    bucket_bytes: int, version: int, device: torch.device,
) -> dict[str, float]:
    """Send ``model``'s current weights (every actor rank calls it; the FSDP x TP shards are gathered one parameter at
    a time over ``trainer_group``, all the actor's ranks) in ``dtype``; returns ``weight_sync/bytes``
    and ``/buckets`` (on every actor rank). Buckets go from ``device`` (the rank's own, even for weights offloaded
    to host memory: both sides of a broadcast must use the same backend)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # read the sharded master weights, whatever gathered state the last forward left
    named = list(model.named_parameters())
    shapes = _global_shapes(named)
    sender = rank == sides.source
    element_bytes = torch.empty((), dtype=dtype).element_size()
    # The sender tells the other actor ranks the plan check's outcome, so a mismatch fails every rank at once
    # instead of leaving them in the first gather.
    differ = torch.tensor([int(sender and _plans_differ(_fingerprint(shapes, dtype), sides, version, sender=True))])
    work = dist.broadcast(differ, src=sides.source, group=trainer_group, async_op=True)
    _wait(work, sides, version, "the plan check")
    if int(differ):
        raise _mismatch(sides, version)
    buckets = bucket_plan(shapes, element_bytes=element_bytes, bucket_bytes=bucket_bytes)
    for number, bucket in enumerate(buckets):
        pieces = []
        for index in bucket:
            param = named[index][1]
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if sender:
                pieces.append(full.detach().to(device=device, dtype=dtype).reshape(-1))
        if sender:
            flat = torch.cat(pieces)
            del pieces
            what = f"bucket {number + 1} of {len(buckets)} ({flat.numel() * element_bytes} bytes)"
            _wait(dist.broadcast(flat, src=sides.source, group=sides.group, async_op=True), sides, version, what)
    moved = sum(element_bytes * _numel(shape) for _, shape in shapes)
    return {"weight_sync/bytes": float(moved), "weight_sync/buckets": float(len(buckets))}


@torch.no_grad()
def receive_weights(
    model: torch.nn.Module, *, sides: SyncSides, bucket_bytes: int, version: int, device: torch.device,
) -> None:
    """Fill the rollout's generation ``model`` (TP DTensors over the replica's mesh, or plain tensors) with the
    weights ``send_weights`` broadcasts; every rollout rank calls it."""
    named = list(model.named_parameters())
    dtype = named[0][1].dtype
    shapes = _global_shapes(named)
    if _plans_differ(_fingerprint(shapes, dtype), sides, version, sender=False):
        raise _mismatch(sides, version)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    buckets = bucket_plan(shapes, element_bytes=element_bytes, bucket_bytes=bucket_bytes)
    for number, bucket in enumerate(buckets):
        flat = torch.empty(sum(_numel(shapes[index][1]) for index in bucket), dtype=dtype, device=device)
        what = f"bucket {number + 1} of {len(buckets)} ({flat.numel() * element_bytes} bytes)"
        _wait(dist.broadcast(flat, src=sides.source, group=sides.group, async_op=True), sides, version, what)
        offset = 0
        for index in bucket:
            param = named[index][1]
            full = flat[offset : offset + _numel(shapes[index][1])].view(shapes[index][1])
            offset += full.numel()
            _local_target(param).copy_(_local_shard(param, full))


def _local_target(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _local_shard(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` under ``param``'s placements (``Shard(d)`` cuts like ``torch.chunk``)."""
    if not isinstance(param, DTensor):
        return full
    piece = full
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            size = param.device_mesh.size(mesh_dim)
            coordinate = param.device_mesh.get_local_rank(mesh_dim)
            piece = piece.chunk(size, dim=placement.dim)[coordinate]
    return piece
