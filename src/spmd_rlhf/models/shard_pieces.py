"""Where a rank's shard of a parameter sits in the full tensor: the rectangle (offset and shape) that loading reads
from a checkpoint and that saving sends to the writer.

A DTensor's local shard under any mix of ``Shard`` placements (FSDP2's uneven dim-0 chunks, TP's row or column
splits, both on a 2-D (dp, tp) mesh) is one rectangle of the full tensor, the same one DCP records when it saves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Piece:
    """The rectangle of a full tensor that one rank holds: where it starts in every dimension, and its shape."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        """The piece as an index into the full tensor."""
        return tuple(slice(start, start + size) for start, size in zip(self.offset, self.shape))

    def rows(self, start: int, stop: int) -> tuple[int, int] | None:
        """The piece's rows within the band ``[start, stop)`` of the full tensor's first dimension, relative to the
        piece; None when they do not meet. A 0-d piece is its only row."""
        if not self.shape:
            return (0, 1)
        low, high = max(start, self.offset[0]), min(stop, self.offset[0] + self.shape[0])
        return (low - self.offset[0], high - self.offset[0]) if low < high else None

    def in_band(self, band: torch.Tensor, start: int, rows: tuple[int, int]) -> torch.Tensor:
        """The part of ``band`` (rows ``start..`` of the full tensor, every column) that holds this piece's ``rows``
        (as ``rows`` returned them): a view, to fill from the piece or to read into it."""
        if not self.shape:
            return band
        view = band[rows[0] + self.offset[0] - start : rows[1] + self.offset[0] - start]
        for dim in range(1, len(self.shape)):
            view = view.narrow(dim, self.offset[dim], self.shape[dim])
        return view


def local_piece(param: torch.Tensor, expert: int | None = None) -> tuple[torch.Tensor, Piece]:
    """This rank's data of a parameter (sharing its storage) and where it sits in the full tensor: a DTensor's
    local shard (the unpadded chunk of each ``Shard`` placement; empty on ranks past an uneven split), a plain
    tensor whole. ``expert``: the same for ``param[expert]``, one expert of a 3-D expert parameter (empty where this
    rank holds none of it)."""
    if not isinstance(param, DTensor):
        local, piece = param.detach(), Piece((0,) * param.dim(), tuple(param.shape))
    else:
        local = param.to_local().detach()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        assert tuple(shape) == tuple(local.shape), (param.placements, shape, local.shape)
        piece = Piece(tuple(offset), tuple(shape))
    if expert is None:
        return local, piece
    first = piece.offset[0]
    if not first <= expert < first + piece.shape[0]:
        return local.new_empty(0), Piece((0,), (0,))
    return local[expert - first], Piece(piece.offset[1:], piece.shape[1:])
