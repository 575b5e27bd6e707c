"""``Batch``: the unit of data every role method takes and returns.

Rows are responses (or prompts); every tensor field has the row count as its first dimension, every non-tensor field is
a list with one entry per row, and ``meta`` holds batch-wide values (step number, sampling settings). ``group_size``
is the number of consecutive rows that belong to one prompt (the n samples of GRPO / RLOO / ReMax); splitting never
separates a group, so group baselines can be computed wherever a shard lands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: itself when it is there already; from the host to a GPU through pinned memory without
    blocking the host (a pageable or blocking copy waits for the GPU to drain its queue first)."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_device_together(tensors: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """``tensors`` on ``device``: from the host to a GPU as one pinned, non-blocking copy of all their bytes (one
    transfer and one pinned buffer, not one of each per tensor), each then a view of it in its own dtype and shape;
    elsewhere each as ``to_device`` moves it."""
    device = torch.device(device)
    if device.type != "cuda" or all(tensor.device == device for tensor in tensors.values()):
        return {name: to_device(tensor, device) for name, tensor in tensors.items()}
    return through_one_buffer(tensors, device, pinned=True)


def through_one_buffer(
    tensors: dict[str, torch.Tensor], device: torch.device, *, pinned: bool
) -> dict[str, torch.Tensor]:
    """``to_device_together``'s copy: the host tensors' bytes laid end to end in one ``uint8`` buffer (each piece
    16-byte aligned, so that it can be viewed in any dtype), pinned when ``pinned``, moved in one copy."""
    pieces, total = {}, 0
    for name, tensor in tensors.items():
        start = -(-total // 16) * 16
        pieces[name] = (start, tensor.numel() * tensor.element_size())
        total = start + pieces[name][1]
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    for name, tensor in tensors.items():
        start, size = pieces[name]
        host[start : start + size].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    moved = host.to(device, non_blocking=pinned)
    return {
        name: moved[start : start + size].view(tensor.dtype).view(tensor.shape)
        for (name, tensor), (start, size) in zip(tensors.items(), pieces.values())
    }


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensor fields, each ``[rows, ...]``."""
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    """Per-row Python values (prompts as text, ground truths, data sources, extra info), one list entry per row."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Batch-wide values, carried along by every operation."""
    group_size: int = 1
    """Consecutive rows that belong to one prompt and must stay together."""

    def __post_init__(self) -> None:
        lengths = {name: len(value) for name, value in {**self.tensors, **self.non_tensors}.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"batch fields have different row counts: {lengths}")
        if self.group_size < 1 or len(self) % self.group_size:
            raise ValueError(f"{len(self)} rows do not divide into groups of {self.group_size}")

    def __len__(self) -> int:
        for value in (*self.tensors.values(), *self.non_tensors.values()):
            return len(value)
        return 0

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __getitem__(self, key: str) -> torch.Tensor | list[Any]:
        return self.tensors[key] if key in self.tensors else self.non_tensors[key]

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def select(self, rows: Sequence[int] | torch.Tensor, *, group_size: int = 1) -> Batch:
        """The given rows in the given order; ``group_size`` of the result (row selection may break groups)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        positions = index.tolist()
        # One copy of the index per device the fields are on (usually one), not one per field.
        indices = {device: to_device(index, device) for device in {value.device for value in self.tensors.values()}}
        return Batch(
            {name: value.index_select(0, indices[value.device]) for name, value in self.tensors.items()},
            {name: [value[i] for i in positions] for name, value in self.non_tensors.items()},
            dict(self.meta),
            group_size,
        )

    def select_groups(self, groups: Sequence[int] | torch.Tensor) -> Batch:
        """Whole groups by group index, keeping ``group_size``."""
        groups = torch.as_tensor(groups, dtype=torch.long)
        rows = (groups[:, None] * self.group_size + torch.arange(self.group_size)).flatten()
        return self.select(rows, group_size=self.group_size)

    def split(self, parts: int) -> list[Batch]:
        """``parts`` contiguous shards of whole groups, sizes differing by at most one group (e.g. one per DP rank)."""
        if parts < 1:
            raise ValueError(f"cannot split into {parts} parts")
        base, extra = divmod(self.num_groups, parts)
        shards, start = [], 0
        for part in range(parts):
            count = base + (part < extra)
            shards.append(self.select_groups(range(start, start + count)))
            start += count
        return shards

    def slice(self, start: int, stop: int, *, group_size: int = 1) -> Batch:
        """Rows ``[start, stop)`` as views of this batch's tensors (no copy)."""
        return Batch(
            {name: value[start:stop] for name, value in self.tensors.items()},
            {name: value[start:stop] for name, value in self.non_tensors.items()},
            dict(self.meta),
            group_size,
        )

    def chunk_rows(self, rows_per_chunk: int) -> list[Batch]:
        """Consecutive chunks of ``rows_per_chunk`` rows (mini- and micro-batches, views); the last may be shorter."""
        if rows_per_chunk < 1:
            raise ValueError(f"rows_per_chunk={rows_per_chunk} must be >= 1")
        return [
            self.slice(start, min(start + rows_per_chunk, len(self))) for start in range(0, len(self), rows_per_chunk)
        ]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of ``batches`` one after another; fields and group sizes must agree, meta of the first is kept."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for other in batches[1:]:
            if other.keys() != first.keys() or other.group_size != first.group_size:
                raise ValueError(
                    f"cannot concat batches with fields {first.keys()} (group size {first.group_size}) and "
                    f"{other.keys()} (group size {other.group_size})"
                )
        return Batch(
            {name: torch.cat([b.tensors[name] for b in batches]) for name in first.tensors},
            {name: [item for b in batches for item in b.non_tensors[name]] for name in first.non_tensors},
            dict(first.meta),
            first.group_size,
        )

    def union(self, other: Batch) -> Batch:
        """Fields of both batches over the same rows; a field present in both must be equal, and so must group sizes
        above 1 (a batch computed row by row, group size 1, takes the other's grouping)."""
        if len(other) != len(self):
            raise ValueError(f"cannot union a batch of {len(self)} rows with one of {len(other)} rows")
        for name in set(self.tensors) & set(other.tensors):
            if not torch.equal(self.tensors[name], other.tensors[name]):
                raise ValueError(f"union: field {name!r} differs between the two batches")
        for name in set(self.non_tensors) & set(other.non_tensors):
            if self.non_tensors[name] != other.non_tensors[name]:
                raise ValueError(f"union: field {name!r} differs between the two batches")
        if 1 < self.group_size != other.group_size > 1:
            raise ValueError(f"union: group sizes {self.group_size} and {other.group_size} disagree")
        return Batch(
            {**self.tensors, **other.tensors},
            {**self.non_tensors, **other.non_tensors},
            {**self.meta, **other.meta},
            max(self.group_size, other.group_size),
        )

    def repeat(self, times: int) -> Batch:
        """Each row ``times`` times in a row (prompt -> its n samples); the result's groups are those copies."""
        if times < 1:
            raise ValueError(f"repeat times={times} must be >= 1")
        rows = torch.arange(len(self)).repeat_interleave(times)
        return self.select(rows, group_size=self.group_size * times)

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Append copies of the first groups until the group count divides by ``multiple``; returns (batch, rows added).

        Used so every DP rank gets the same number of groups; the caller drops the last ``rows added`` rows of results.
        """
        missing = -self.num_groups % multiple
        if missing == 0:
            return self, 0
        if self.num_groups == 0:
            raise ValueError("cannot pad an empty batch")
        padding = self.select_groups([index % self.num_groups for index in range(missing)])
        return Batch.concat([self, padding]), missing * self.group_size

    def to(self, device: torch.device | str) -> Batch:
        """The batch with its tensors on ``device`` (``to_device``: from the host to a GPU without blocking)."""
        return Batch(
            {n: to_device(v, device) for n, v in self.tensors.items()},
            dict(self.non_tensors),
            dict(self.meta),
            self.group_size,
        )
