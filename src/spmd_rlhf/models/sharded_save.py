"""A sharded model (FSDP2 x TP DTensors, maybe one pipeline stage of it) written as a Hugging Face directory without
any rank ever holding the whole model, or even one whole tensor of it.

Each pipeline stage has a writer, the stage's first rank; it writes that stage's tensors into files of its own (a
file never spans two stages). Per tensor, in row bands of at most ``band_bytes``, every rank holding a distinct
piece of the band sends that piece to its stage's writer point to point; the writer assembles the band and appends
it to the file (``safetensors_stream``). Only small metadata moves otherwise: each rank tells its writer which
pieces it holds (offset and shape), the writer tells each rank which of them to send, and the stages' writers
exchange names, shapes and dtypes so that every writer knows the file plan. Stage 0's writer writes the index,
``config.json`` and the tokenizer.

    save_sharded_pretrained(model, out_dir, stage=0, stage_ranks=[0, 1, 2, 3], writers_group=None, group=None,
                            dtype=torch.bfloat16, device=torch.device("cpu"))
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.safetensors_stream import (
    PlannedFile,
    SafetensorsWriter,
    TensorEntry,
    plan_files,
    row_bands,
    write_index,
)
from spmd_rlhf.models.shard_pieces import Piece, local_piece
from spmd_rlhf.models.weights import model_layout, write_hf_metadata

DEFAULT_BAND_BYTES = 64 * 2**20
"""The most bytes of one tensor a writer assembles at a time (a band of whole rows; one row if a row is larger)."""


def _point_to_point(op: Callable, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> None:
    """Send or receive one tensor (``op``: ``dist.isend`` / ``dist.irecv``; ``peer``: a global rank) and wait until
    it has arrived, so that one piece at a time is in flight. Device tensors go as a batch of one: NCCL runs batched
    point-to-point ops on ``group``'s communicator, where a lone send would open a communicator per pair of ranks."""
    if tensor.device.type == "cuda":
        dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)])[0].wait()
        torch.cuda.current_stream(tensor.device).synchronize()
    else:
        op(tensor, peer, group=group).wait()


def _send_json(value: object, peer: int, group: dist.ProcessGroup | None) -> None:
    """Small metadata (names, offsets, shapes) as JSON bytes in host tensors (gloo)."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    _point_to_point(dist.isend, torch.tensor([data.numel()]), peer, group)
    _point_to_point(dist.isend, data, peer, group)


def _recv_json(peer: int, group: dist.ProcessGroup | None) -> object:
    length = torch.empty(1, dtype=torch.int64)
    _point_to_point(dist.irecv, length, peer, group)
    data = torch.empty(int(length), dtype=torch.uint8)
    _point_to_point(dist.irecv, data, peer, group)
    return json.loads(data.numpy().tobytes())


def _assign_senders(
    pieces: dict[int, dict[str, Piece]], entries: list[TensorEntry], writer: int
) -> dict[int, list[str]]:
    """Which rank sends which tensors' pieces: one holder per distinct piece (the writer when it holds it, else the
    lowest rank). Raises if the distinct pieces do not tile a tensor, which no DTensor layout should produce."""
    chosen: dict[str, dict[Piece, int]] = {entry.name: {} for entry in entries}
    for rank in sorted(pieces, key=lambda rank: (rank != writer, rank)):
        for name, piece in pieces[rank].items():
            chosen[name].setdefault(piece, rank)
    for entry in entries:
        held, size = sum(piece.numel for piece in chosen[entry.name]), math.prod(entry.shape)
        if held != size:
            raise RuntimeError(f"{entry.name}: the ranks' distinct pieces hold {held} of its {size} elements")
    senders: dict[int, list[str]] = {rank: [] for rank in pieces}
    for name, by_piece in chosen.items():
        for rank in by_piece.values():
            senders[rank].append(name)
    return senders


def ready_point_to_point(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Batched point-to-point ops (NCCL) on a communicator not yet used need all its ranks: one collective creates
    it. Every rank of ``group`` calls this before the first piece moves; nothing to do off CUDA."""
    if device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def exchange_pieces(
    held: dict[str, tuple[torch.Tensor, Piece]],
    entries: list[TensorEntry],
    *,
    stage_ranks: list[int],
    group: dist.ProcessGroup | None,
) -> tuple[set[str], dict[str, dict[int, Piece]]]:
    """Tell the writer which pieces this rank holds (``held``: each entry's local data and piece, ``local_piece``)
    and learn which to send. Returns (the names whose piece this rank sends, and on the writer, for every tensor,
    each sending rank's piece)."""
    writer = stage_ranks[0]
    mine = {name: piece for name, (local, piece) in held.items() if local.numel()}
    if dist.get_rank() != writer:
        _send_json({name: [piece.offset, piece.shape] for name, piece in mine.items()}, writer, group)
        return set(_recv_json(writer, group)), {}
    pieces = {writer: mine}
    for other in stage_ranks[1:]:
        theirs = _recv_json(other, group)
        pieces[other] = {name: Piece(tuple(offset), tuple(shape)) for name, (offset, shape) in theirs.items()}
    senders = _assign_senders(pieces, entries, writer)
    for other in stage_ranks[1:]:
        _send_json(senders[other], other, group)
    by_name: dict[str, dict[int, Piece]] = {entry.name: {} for entry in entries}
    for sender, names in senders.items():
        for name in names:
            by_name[name][sender] = pieces[sender][name]
    return set(senders[writer]), by_name


def _plan(
    entries: list[TensorEntry], *, stage: int, writers_group: dist.ProcessGroup | None, max_shard_bytes: int
) -> list[PlannedFile]:
    """The directory's file plan, the same on every stage writer: each stage's entries in stage order."""
    stages = [(stage, entries)]
    if writers_group is not None:
        stages = [None] * dist.get_world_size(writers_group)
        dist.all_gather_object(stages, (stage, entries), group=writers_group)
    return plan_files(
        [stage_entries for _, stage_entries in sorted(stages, key=lambda item: item[0])],
        max_shard_bytes=max_shard_bytes,
    )


@torch.no_grad()
def save_sharded_pretrained(
    model: DecoderLM,
    out_dir: str | os.PathLike,
    *,
    stage: int,
    stage_ranks: list[int],
    writers_group: dist.ProcessGroup | None,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer=None,
    band_bytes: int = DEFAULT_BAND_BYTES,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write the whole model, whose pipeline stage ``stage`` this rank holds (sharded over ``stage_ranks``, the
    global ranks of that stage, writer first), as a Hugging Face directory in ``dtype``. Every rank of ``group``
    (all stages' ranks; None: the default group) calls it; ``writers_group`` joins the stages' writers (None with
    one stage); pieces travel on ``device`` (the rank's device: NCCL on GPU), metadata in host memory. Returns the
    files this rank wrote.

    Memory at peak: a sending rank holds its shard plus one piece of a band converted to ``dtype`` (at most
    ``band_bytes``); a writer holds its shard plus one band being assembled, one received piece and one of its own
    pieces converted (each at most ``band_bytes``, or one row of a tensor when a row is larger).
    """
    ready_point_to_point(group, device)
    # named_parameters drops the tied lm_head alias, exactly as Hugging Face stores tied checkpoints.
    params = dict(model.named_parameters())
    # The tensors as published (``checkpoint_names``): an expert parameter is one tensor per expert.
    stored = [part for parts in model_layout(model).values() for part in parts]
    entries = [TensorEntry(part.name, part.shape, dtype) for part in stored]
    held = {part.name: local_piece(params[part.parameter], part.expert) for part in stored}
    sending, pieces = exchange_pieces(held, entries, stage_ranks=stage_ranks, group=group)
    writer = stage_ranks[0]
    if dist.get_rank() != writer:
        send_band_pieces(held, entries, sending, writer=writer, band_bytes=band_bytes, device=device, group=group)
        return []
    os.makedirs(out_dir, exist_ok=True)
    files = _plan(entries, stage=stage, writers_group=writers_group, max_shard_bytes=max_shard_bytes)
    written = []
    for planned in files:
        if planned.entries[0].name not in held:
            continue  # another stage's file
        with SafetensorsWriter(out_dir, planned) as file:
            for entry in planned.entries:
                bands = assembled_bands(
                    entry,
                    held[entry.name][0],
                    pieces[entry.name],
                    band_bytes=band_bytes,
                    device=device,
                    group=group,
                    band_device=torch.device("cpu"),
                )
                for _, band in bands:
                    file.write(band)
                    del band
        written.append(str(file.path))
    if stage == 0:
        index = write_index(out_dir, files)
        written.extend([index] if index else [])
        written.extend(write_hf_metadata(out_dir, model.args, head=model.head, dtype=dtype, tokenizer=tokenizer))
    return written


def _rows_of(tensor: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    return tensor[rows[0] : rows[1]] if tensor.dim() else tensor


def send_band_pieces(
    held: dict[str, tuple[torch.Tensor, Piece]],
    entries: list[TensorEntry],
    sending: set[str],
    *,
    writer: int,
    band_bytes: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> None:
    """A rank other than the writer: send, in ``entries`` order, this rank's piece of every row band of each tensor
    it sends (``sending``, from ``exchange_pieces``), in the entry's dtype, one piece in flight at a time. Holds one
    piece of a band at a time (at most ``band_bytes``, or one row)."""
    for entry in entries:
        if entry.name not in sending:
            continue
        local, piece = held[entry.name]
        for start, stop in row_bands(entry.shape, entry.dtype.itemsize, band_bytes):
            rows = piece.rows(start, stop)
            if rows is not None:
                band_piece = _rows_of(local, rows).to(device=device, dtype=entry.dtype).contiguous()
                _point_to_point(dist.isend, band_piece, writer, group)
                del band_piece  # before the next one is made


def assembled_bands(
    entry: TensorEntry,
    local: torch.Tensor,
    senders: dict[int, Piece],
    *,
    band_bytes: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
    band_device: torch.device,
) -> Iterator[tuple[int, torch.Tensor]]:
    """The writer: each row band of one tensor, assembled on ``band_device`` from its senders' pieces (the writer's
    own, ``local``, and the others' in the order ``send_band_pieces`` sends them), with its first row. Holds one
    band, one received piece and, while it is copied, one of its own pieces converted."""
    writer = dist.get_rank()
    for start, stop in row_bands(entry.shape, entry.dtype.itemsize, band_bytes):
        band = torch.empty(
            (stop - start, *entry.shape[1:]) if entry.shape else (), dtype=entry.dtype, device=band_device
        )
        for sender in sorted(senders):
            piece = senders[sender]
            rows = piece.rows(start, stop)
            if rows is None:
                continue
            if sender == writer:
                received = _rows_of(local, rows).to(dtype=entry.dtype)
            else:
                received = torch.empty(
                    (rows[1] - rows[0], *piece.shape[1:]) if piece.shape else (), dtype=entry.dtype, device=device
                )
                _point_to_point(dist.irecv, received, sender, group)
            piece.in_band(band, start, rows).copy_(received)
            del received
        yield start, band
        del band
