"""The data plane: moving rows of a stored batch from the ranks that made them to the ranks that consume them.

The coordinator only plans (``plan_exchanges``: which rows of which owner go to which rank, from row counts alone);
the ranks move the bytes themselves with ``isend``/``irecv`` on the global process group (``run_exchanges``), inside
commands that the coordinator schedules on both sides. Device tensors go in one ``batch_isend_irecv`` group per round:
NCCL matches a pair's sends and receives in issue order on one stream, so a pairwise exchange (two ranks sending to
each other) posted op by op deadlocks. gloo's are independent, and host tensors go one by one (gloo's
``batch_isend_irecv`` does the same); ``grouped`` selects either path for tests. Rows a rank already holds are
sliced locally, so a consumer colocated with the producer under the same DP layout moves nothing.

Per-row Python values (non-tensor fields) travel as pickled bytes; because their size is not known in advance, they
take one extra round (a length message) before the payload round. Tensor shapes are known from the plan.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import Batch

_MESSAGES_PER_EXCHANGE = 1024
_TAG_SPACE = 2**30

_traffic = {"sent": 0, "received": 0}


def traffic() -> dict[str, int]:
    """Bytes this process has sent and received on the data plane so far (tests and benchmarks read it)."""
    return dict(_traffic)


@dataclass(frozen=True)
class ShardInfo:
    """One DP shard of a stored batch, as the coordinator sees it."""

    owner: int
    """Global rank that holds the rows."""
    rows: int


@dataclass(frozen=True)
class Schema:
    """What every shard of one stored batch has in common; reported by the owners, checked by the coordinator."""

    tensor_specs: dict[str, tuple[str, tuple[int, ...]]]
    """Tensor field -> (dtype name, shape after the row dimension)."""
    non_tensor_keys: tuple[str, ...]
    group_size: int
    meta: dict[str, Any]

    @classmethod
    def of(cls, batch: Batch) -> Schema:
        return cls(
            {
                name: (str(value.dtype).removeprefix("torch."), tuple(value.shape[1:]))
                for name, value in batch.tensors.items()
            },
            tuple(batch.non_tensors),
            batch.group_size,
            dict(batch.meta),
        )

    def differences(self, other: Schema) -> list[str]:
        """Human-readable list of what disagrees between two shards' schemas (meta may differ)."""
        found = []
        if self.tensor_specs != other.tensor_specs:
            found.append(f"tensor fields {self.tensor_specs} vs {other.tensor_specs}")
        if self.non_tensor_keys != other.non_tensor_keys:
            found.append(f"non-tensor fields {list(self.non_tensor_keys)} vs {list(other.non_tensor_keys)}")
        if self.group_size != other.group_size:
            found.append(f"group size {self.group_size} vs {other.group_size}")
        return found


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of the batch stored as ``batch_id`` on rank ``source``."""

    source: int
    start: int
    stop: int


@dataclass
class Exchange:
    """One rank's part in moving one stored batch to a consumer layout."""

    batch_id: int
    tag: int
    """First point-to-point tag of this transfer; the same on every rank taking part."""
    schema: Schema
    sends: list[tuple[int, int, int]] = field(default_factory=list)
    """(destination rank, start, stop) rows of this rank's stored shard that another rank needs."""
    pieces: list[Piece] | None = None
    """Rows this rank assembles into its input, in order; ``None`` on ranks that only send."""


def transfer_tag(transfer_id: int) -> int:
    return (transfer_id * _MESSAGES_PER_EXCHANGE) % _TAG_SPACE


def plan_exchanges(
    *, batch_id: int, shards: list[ShardInfo], schema: Schema, consumers: list[list[int]], transfer_id: int
) -> dict[int, Exchange]:
    """Work out, for every rank involved, what it sends and which pieces it assembles.

    The groups are split evenly over the consumer DP ranks, as ``Batch.split`` does; a consumer with the producer's
    layout on the producer's ranks then finds each even shard where it already is and moves nothing, while uneven
    shards (rows selected in place) are rebalanced."""
    group_size = schema.group_size
    starts, total = [], 0
    for shard in shards:
        starts.append(total)
        total += shard.rows
    base, extra = divmod(total // group_size, len(consumers))
    counts = [(base + (dp_rank < extra)) * group_size for dp_rank in range(len(consumers))]
    tag = transfer_tag(transfer_id)
    exchanges: dict[int, Exchange] = {}

    def exchange(rank: int) -> Exchange:
        if rank not in exchanges:
            exchanges[rank] = Exchange(batch_id, tag, schema)
        return exchanges[rank]

    first = 0
    for ranks, count in zip(consumers, counts):
        wanted = (first, first + count)
        first += count
        pieces = []
        for shard, shard_start in zip(shards, starts):
            start, stop = max(wanted[0], shard_start), min(wanted[1], shard_start + shard.rows)
            if start < stop:
                pieces.append(Piece(shard.owner, start - shard_start, stop - shard_start))
        for rank in ranks:
            exchange(rank).pieces = pieces
            for piece in pieces:
                if piece.source != rank:
                    exchange(piece.source).sends.append((rank, piece.start, piece.stop))
    return exchanges


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def groups_point_to_point(device: torch.device) -> bool:
    """Whether sends and receives of tensors on ``device`` must be posted as one ``batch_isend_irecv`` group: yes
    for every device but the host (NCCL and its kin), whatever the process group's backend string says."""
    return device.type != "cpu"


def run_exchanges(
    exchanges: list[Exchange], *, rank: int, store: dict[int, Batch], device: torch.device, grouped: bool | None = None
) -> list[Batch | None]:
    """Carry out this rank's part of several transfers at once (all sends and receives posted together, so ranks
    that both send and receive cannot deadlock); returns the assembled batch of each exchange (``None`` for
    send-only ones). Tensors arrive on ``device`` (the process group's device). ``grouped``: post each round as one
    ``batch_isend_irecv`` group (True) or op by op (False); None: ``groups_point_to_point(device)``."""
    if grouped is None:
        grouped = groups_point_to_point(device)
    sources = [
        store[exchange.batch_id] if exchange.sends or _has_local(exchange, rank) else None for exchange in exchanges
    ]
    payloads: list[dict[tuple[int, int], bytes]] = []
    lengths_in, ops = [], []
    for exchange, source in zip(exchanges, sources):
        encoded: dict[tuple[int, int], bytes] = {}
        if exchange.schema.non_tensor_keys:
            for destination, start, stop in exchange.sends:
                if (start, stop) not in encoded:  # TP / PP replicas of one DP rank get the same rows
                    encoded[(start, stop)] = pickle.dumps(
                        {name: source.non_tensors[name][start:stop] for name in exchange.schema.non_tensor_keys}
                    )
                length = torch.tensor([len(encoded[(start, stop)])], dtype=torch.int64, device=device)
                ops.append(dist.P2POp(dist.isend, length, destination, tag=exchange.tag))
        payloads.append(encoded)
        incoming = {}
        if exchange.schema.non_tensor_keys:
            for piece in _remote_pieces(exchange, rank):
                incoming[piece] = torch.empty(1, dtype=torch.int64, device=device)
                ops.append(dist.P2POp(dist.irecv, incoming[piece], piece.source, tag=exchange.tag))
        lengths_in.append(incoming)
    _wait_all(ops, grouped=grouped)

    ops, received = [], []
    for exchange, source, encoded, incoming in zip(exchanges, sources, payloads, lengths_in):
        tag = exchange.tag + 1
        specs = exchange.schema.tensor_specs
        for destination, start, stop in exchange.sends:
            if encoded:
                data = torch.frombuffer(bytearray(encoded[(start, stop)]), dtype=torch.uint8).to(device)
                ops.append(dist.P2POp(dist.isend, data, destination, tag=tag))
            for index, name in enumerate(specs):
                value = source.tensors[name][start:stop].to(device).contiguous()
                if value.numel():
                    ops.append(dist.P2POp(dist.isend, value, destination, tag=tag + 1 + index))
        buffers: dict[Piece, tuple[torch.Tensor | None, dict[str, torch.Tensor]]] = {}
        for piece in _remote_pieces(exchange, rank):
            data = None
            if piece in incoming:
                data = torch.empty(int(incoming[piece].item()), dtype=torch.uint8, device=device)
                ops.append(dist.P2POp(dist.irecv, data, piece.source, tag=tag))
            tensors = {}
            for index, (name, (dtype, shape)) in enumerate(specs.items()):
                tensors[name] = torch.empty((piece.stop - piece.start, *shape), dtype=_dtype(dtype), device=device)
                if tensors[name].numel():
                    ops.append(dist.P2POp(dist.irecv, tensors[name], piece.source, tag=tag + 1 + index))
            buffers[piece] = (data, tensors)
        received.append(buffers)
    _wait_all(ops, grouped=grouped)

    results: list[Batch | None] = []
    for exchange, source, buffers in zip(exchanges, sources, received):
        if exchange.pieces is None:
            results.append(None)
            continue
        parts = []
        for piece in exchange.pieces:
            if piece.source == rank:
                parts.append(source.slice(piece.start, piece.stop).to(device))
            else:
                data, tensors = buffers[piece]
                non_tensors = pickle.loads(data.cpu().numpy().tobytes()) if data is not None else {}
                parts.append(Batch(tensors, non_tensors))
        results.append(_assemble(parts, exchange.schema, device))
    return results


def _has_local(exchange: Exchange, rank: int) -> bool:
    return exchange.pieces is not None and any(piece.source == rank for piece in exchange.pieces)


def _remote_pieces(exchange: Exchange, rank: int) -> list[Piece]:
    return [piece for piece in exchange.pieces or [] if piece.source != rank]


def _assemble(parts: list[Batch], schema: Schema, device: torch.device) -> Batch:
    if not parts:
        tensors = {
            name: torch.empty((0, *shape), dtype=_dtype(dtype), device=device)
            for name, (dtype, shape) in schema.tensor_specs.items()
        }
        return Batch(tensors, {name: [] for name in schema.non_tensor_keys}, dict(schema.meta), schema.group_size)
    joined = parts[0] if len(parts) == 1 else Batch.concat([Batch(part.tensors, part.non_tensors) for part in parts])
    return Batch(joined.tensors, joined.non_tensors, dict(schema.meta), schema.group_size)


def _wait_all(ops: list[dist.P2POp], *, grouped: bool) -> None:
    if not ops:
        return
    if grouped:
        works = dist.batch_isend_irecv(ops)
    else:
        works = [op.op(op.tensor, op.peer, tag=op.tag) for op in ops]
    for work in works:
        work.wait()
    for op in ops:
        _traffic["sent" if op.op is dist.isend else "received"] += op.tensor.numel() * op.tensor.element_size()
