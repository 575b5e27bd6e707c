"""The trainer's weights sent to the rollout role's replicas, mesh to mesh.

The actor trains with FSDP x TP DTensors on its mesh; the rollout generates with TP-sharded weights (one copy per
replica) on another mesh over other ranks. DTensor cannot redistribute from one mesh to another, so the sync is a
broadcast over the ``weight_sync`` group (the actor's first rank and every rollout rank), in row bands, so that no
rank ever holds a whole parameter (a 7B model's 150k-row embedding is 2.4 GB in float32):

  1. every parameter is cut into row bands of at most ``bucket_bytes`` in the rollout's dtype
     (``safetensors_stream.row_bands``, as the streamed Hugging Face save cuts them); each actor rank holding a
     distinct piece of a band sends that piece, cast, to the actor's first rank point to point, which assembles the
     band (``sharded_save.send_band_pieces`` / ``assembled_bands``, the save's own code) and packs it into the bucket;
  2. a full bucket (``rollout.sync_bucket_mb``; consecutive bands while they fit) is broadcast to the rollout ranks,
     each of which copies the part of every band that falls in its TP shard into its generation model.

Both sides derive the same plan from the parameters' names and global shapes, and check it first: a model that
differs on the two sides fails at once on both, naming them. Every wait is bounded by ``timeout_s`` and a failure
names the version, both sides' ranks and the bucket. The rollout's weights then equal the trainer's cast to its
dtype, bit for bit.

Peak per rank, besides its own shards: an actor rank other than the first one piece of a band (at most
``bucket_bytes``); the first actor rank one bucket, one band being assembled and one piece; a rollout rank one bucket.
"""

from __future__ import annotations

import json
import threading
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from spmd_rlhf.models.safetensors_stream import TensorEntry, row_bands
from spmd_rlhf.models.shard_pieces import local_piece
from spmd_rlhf.models.sharded_save import assembled_bands, exchange_pieces, ready_point_to_point, send_band_pieces
from spmd_rlhf.runtime.device import bind_thread


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
        return (
            f"weight sync of policy version {version} from actor rank {self.source} to rollout ranks "
            f"{list(self.rollout_ranks)}"
        )


def sync_group_ranks(actor_ranks: tuple[int, ...], rollout_ranks: tuple[int, ...]) -> list[int]:
    """The ranks of the ``weight_sync`` group: the actor's first rank, then the rollout's."""
    return [actor_ranks[0], *rollout_ranks]


@dataclass(frozen=True)
class Band:
    """Rows ``start:stop`` of parameter ``index`` (its only "row" for a 0-d parameter), in the rollout's dtype."""

    index: int
    start: int
    stop: int
    numel: int


def sync_bands(shapes: list[tuple[str, tuple[int, ...]]], *, element_bytes: int, bucket_bytes: int) -> list[Band]:
    """Every row band the sync moves, in order: each parameter cut into bands of at most ``bucket_bytes`` (one row
    where a row is larger)."""
    return [
        Band(index, start, stop, (stop - start) * _numel(shape[1:]) if shape else 1)
        for index, (_, shape) in enumerate(shapes)
        for start, stop in row_bands(shape, element_bytes, bucket_bytes)
    ]


def bucket_plan(sizes: list[int], *, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` (bytes) in each bucket, in order: consecutive items while they fit ``bucket_bytes``; an
    item larger than that is a bucket of its own."""
    buckets: list[list[int]] = []
    filled = bucket_bytes  # forces a first bucket
    for index, size in enumerate(sizes):
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


def trainer_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name as its sharded master weights (FSDP units resharded first, whatever gathered
    state the last forward left): what ``send_weights`` sends."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return dict(model.named_parameters())


@torch.no_grad()
def snapshot(params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A copy of every parameter's shard in ``dtype`` (a DTensor keeps its mesh and placements), for a send that
    runs while training changes the parameters: this rank's shards once more in the rollout's dtype, no more."""
    return {name: _copy(param.detach(), dtype) for name, param in params.items()}


def _copy(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return param.to(dtype=dtype, copy=True)
    local = param.to_local().to(dtype=dtype, copy=True)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _plan(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int):
    element_bytes = torch.empty((), dtype=dtype).element_size()
    bands = sync_bands(shapes, element_bytes=element_bytes, bucket_bytes=bucket_bytes)
    buckets = bucket_plan([band.numel * element_bytes for band in bands], bucket_bytes=bucket_bytes)
    return element_bytes, bands, buckets


def sync_metrics(params: dict[str, torch.Tensor], *, dtype: torch.dtype, bucket_bytes: int) -> dict[str, float]:
    """``weight_sync/bytes`` (the weights in the rollout's ``dtype``) and ``weight_sync/buckets`` of a sync."""
    return _plan_metrics(*_plan(_global_shapes(list(params.items())), dtype, bucket_bytes))


def _plan_metrics(element_bytes: int, bands: list, buckets: list[list[int]]) -> dict[str, float]:
    moved = sum(band.numel for band in bands) * element_bytes
    return {"weight_sync/bytes": float(moved), "weight_sync/buckets": float(len(buckets))}


@torch.no_grad()
def send_weights(
    params: dict[str, torch.Tensor],
    *,
    sides: SyncSides,
    rank: int,
    trainer_group: dist.ProcessGroup,
    dtype: torch.dtype,
    bucket_bytes: int,
    version: int,
    device: torch.device,
) -> dict[str, float]:
    """Send the weights ``params`` (``trainer_parameters`` or a ``snapshot`` of them) in ``dtype`` (every actor rank
    calls it: each sends its pieces of every row band to the first rank over ``trainer_group``, all the actor's
    ranks); returns ``sync_metrics`` (on every actor rank). Pieces and buckets go from ``device`` (the rank's own,
    even for weights offloaded to host memory: both sides of a broadcast must use the same backend)."""
    named = list(params.items())
    shapes = _global_shapes(named)
    sender = rank == sides.source
    # The sender tells the other actor ranks the plan check's outcome, so a mismatch fails every rank at once
    # instead of leaving them in the first gather.
    differ = torch.tensor([int(sender and _plans_differ(_fingerprint(shapes, dtype), sides, version, sender=True))])
    work = dist.broadcast(differ, src=sides.source, group=trainer_group, async_op=True)
    _wait(work, sides, version, "the plan check")
    if int(differ):
        raise _mismatch(sides, version)
    element_bytes, bands, buckets = _plan(shapes, dtype, bucket_bytes)
    entries = [TensorEntry(name, shape, dtype) for name, shape in shapes]
    actor_ranks = dist.get_process_group_ranks(trainer_group)
    stage_ranks = [sides.source, *(other for other in actor_ranks if other != sides.source)]
    ready_point_to_point(trainer_group, device)
    held = {name: local_piece(param) for name, param in named}
    sending, pieces = exchange_pieces(held, entries, stage_ranks=stage_ranks, group=trainer_group)
    if not sender:
        send_band_pieces(
            held, entries, sending, writer=sides.source, band_bytes=bucket_bytes, device=device, group=trainer_group
        )
    else:
        assembled = (
            band
            for entry in entries
            for _, band in assembled_bands(
                entry,
                held[entry.name][0],
                pieces[entry.name],
                band_bytes=bucket_bytes,
                device=device,
                group=trainer_group,
                band_device=device,
            )
        )
        for number, bucket in enumerate(buckets):
            flat = torch.empty(sum(bands[item].numel for item in bucket), dtype=dtype, device=device)
            offset = 0
            for item in bucket:
                flat[offset : offset + bands[item].numel].copy_(next(assembled).reshape(-1))
                offset += bands[item].numel
            what = f"bucket {number + 1} of {len(buckets)} ({flat.numel() * element_bytes} bytes)"
            _wait(dist.broadcast(flat, src=sides.source, group=sides.group, async_op=True), sides, version, what)
            del flat
    return _plan_metrics(element_bytes, bands, buckets)


class BackgroundSender:
    """Sends weight snapshots from a thread of its own, one at a time, so the actor goes on training while the
    rollout finishes the generation queued before the sync and then receives. The thread's collectives run over
    groups the training never uses (a ``trainer_group`` of its own and the ``weight_sync`` group), so they cannot
    interleave with the training's. A send's failure is raised by the next ``start`` or ``wait``."""

    def __init__(self, device: torch.device, *, timeout_s: float) -> None:
        self.device, self.timeout_s = device, timeout_s
        self._thread: threading.Thread | None = None
        self._version = -1
        self._failure: tuple[BaseException, str] | None = None

    def start(self, params: dict[str, torch.Tensor], *, version: int, **send_options) -> None:
        """Send ``params`` (a ``snapshot``: nothing may change them until the send ends) as policy ``version`` with
        ``send_weights(params, version=version, **send_options)`` once the previous send has ended."""
        self.wait()
        if self.device.type == "cuda":
            # The copy ran on this thread's current stream, which the sender's collectives do not wait for.
            torch.cuda.current_stream(self.device).synchronize()
        self._version = version
        self._thread = threading.Thread(
            target=self._send, args=(params, version, send_options), name=f"weight-sync-v{version}", daemon=True
        )
        self._thread.start()

    def _send(self, params: dict[str, torch.Tensor], version: int, send_options: dict) -> None:
        bind_thread(self.device)
        try:
            send_weights(params, version=version, **send_options)
        except BaseException as error:  # raised on the actor's executor thread by the next start / wait
            self._failure = (error, traceback.format_exc())

    def wait(self) -> None:
        """Return once the send in flight (if any) has ended; raise if it failed or has not ended within
        ``timeout_s`` (the rollout never took it)."""
        if self._thread is None:
            return
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the background weight sync of policy version {self._version} has not ended within "
                f"{self.timeout_s:g} s (trainer.collective_timeout_s): the rollout role did not receive it"
            )
        self._thread = None
        if self._failure is not None:
            error, trace = self._failure
            self._failure = None
            raise RuntimeError(
                f"the background weight sync of policy version {self._version} failed: {type(error).__name__}: "
                f"{error}\n{trace}"
            ) from error


@torch.no_grad()
def receive_weights(
    model: torch.nn.Module,
    *,
    sides: SyncSides,
    bucket_bytes: int,
    version: int,
    device: torch.device,
) -> None:
    """Fill the rollout's generation ``model`` (TP DTensors over the replica's mesh, or plain tensors) with the
    weights ``send_weights`` broadcasts; every rollout rank calls it."""
    named = list(model.named_parameters())
    dtype = named[0][1].dtype
    shapes = _global_shapes(named)
    if _plans_differ(_fingerprint(shapes, dtype), sides, version, sender=False):
        raise _mismatch(sides, version)
    element_bytes, bands, buckets = _plan(shapes, dtype, bucket_bytes)
    locals_ = [local_piece(param) for _, param in named]  # each rank's TP shard: a view of the generation weights
    for number, bucket in enumerate(buckets):
        flat = torch.empty(sum(bands[item].numel for item in bucket), dtype=dtype, device=device)
        what = f"bucket {number + 1} of {len(buckets)} ({flat.numel() * element_bytes} bytes)"
        _wait(dist.broadcast(flat, src=sides.source, group=sides.group, async_op=True), sides, version, what)
        offset = 0
        for item in bucket:
            band = bands[item]
            shape = shapes[band.index][1]
            rows_shape = (band.stop - band.start, *shape[1:]) if shape else ()
            received = flat[offset : offset + band.numel].view(rows_shape)
            offset += band.numel
            local, piece = locals_[band.index]
            rows = piece.rows(band.start, band.stop)
            if rows is not None:
                target = local[rows[0] : rows[1]] if shape else local
                target.copy_(piece.in_band(received, band.start, rows))
