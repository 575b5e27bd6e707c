"""Hugging Face safetensors directories written a piece at a time: the file plan (which tensor goes in which file),
a file writer that puts the header first and then takes the tensors' bytes in order, and the index.

The header of a safetensors file lists every tensor's dtype, shape and byte range, and all of that is known before
any weight is read (shapes and dtype come from the model's config), so a file can be written front to back while
its tensors arrive in row bands from wherever they live: no writer ever holds a whole file or a whole model.

    files = plan_files([entries], max_shard_bytes=5 * 2**30)
    for file in files:
        with SafetensorsWriter(out_dir, file) as writer:
            for entry in file.entries:
                for band in bands_of(entry):   # row bands of the tensor, in order
                    writer.write(band)
    write_index(out_dir, files)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its name, full shape and the dtype it is written in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class PlannedFile:
    """A file of the directory and the tensors it holds, in the order their bytes are written."""

    name: str
    entries: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)


def split_by_bytes(entries: list[TensorEntry], limit: int) -> list[list[TensorEntry]]:
    """Consecutive runs of ``entries`` of at most ``limit`` bytes each (a larger tensor is a run of its own)."""
    runs: list[list[TensorEntry]] = []
    size = 0
    for entry in entries:
        if not runs or (runs[-1] and size + entry.nbytes > limit):
            runs.append([])
            size = 0
        runs[-1].append(entry)
        size += entry.nbytes
    return runs


def plan_files(groups: list[list[TensorEntry]], *, max_shard_bytes: int) -> list[PlannedFile]:
    """Split tensors into files of at most ``max_shard_bytes`` (a larger tensor gets a file of its own), in order.
    A file never spans two ``groups`` (e.g. pipeline stages, each written by its own rank). One file is named
    ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors``."""
    files = [run for group in groups for run in split_by_bytes(group, max_shard_bytes)]
    if len(files) == 1:
        return [PlannedFile(SINGLE_FILE, tuple(files[0]))]
    return [
        PlannedFile(f"model-{index + 1:05d}-of-{len(files):05d}.safetensors", tuple(entries))
        for index, entries in enumerate(files)
    ]


def row_bands(shape: tuple[int, ...], itemsize: int, band_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of the first dimension that split a tensor into pieces of at most ``band_bytes``
    (at least one row each): a row band is contiguous in the file's row-major layout. A 0-d tensor is one band."""
    if not shape:
        return [(0, 1)]
    row_bytes = max(1, math.prod(shape[1:]) * itemsize)
    rows = max(1, band_bytes // row_bytes)
    return [(start, min(start + rows, shape[0])) for start in range(0, shape[0], rows)] or [(0, 0)]


class SafetensorsWriter:
    """Writes one planned file: the header on open, then each ``write`` appends the next bytes (its entries' row
    bands, in order). ``close`` checks that exactly the planned bytes arrived. Holds nothing but the file handle."""

    def __init__(self, out_dir: str | os.PathLike, planned: PlannedFile) -> None:
        self.path = Path(out_dir, planned.name)
        self.expected = planned.nbytes
        self.written = 0
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for entry in planned.entries:
            header[entry.name] = {
                "dtype": _DTYPE_NAMES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.nbytes],
            }
            offset += entry.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
        self._handle = open(self.path, "wb")
        self._handle.write(len(encoded).to_bytes(8, "little"))
        self._handle.write(encoded)

    def write(self, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes (a CPU tensor in the planned dtype), without copying them."""
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._handle.write(memoryview(data.numpy()))
        self.written += data.numel()

    def close(self) -> None:
        self._handle.close()
        if self.written != self.expected:
            raise RuntimeError(f"{self.path}: {self.written} bytes written, {self.expected} planned")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._handle.close()


def write_index(out_dir: str | os.PathLike, files: list[PlannedFile]) -> str | None:
    """``model.safetensors.index.json`` naming each tensor's file, when there is more than one file; returns its
    path, or None for a single file (which needs no index)."""
    if len(files) == 1:
        return None
    weight_map = {entry.name: file.name for file in files for entry in file.entries}
    index = {"metadata": {"total_size": sum(file.nbytes for file in files)}, "weight_map": weight_map}
    path = os.path.join(out_dir, INDEX_FILE)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(index, handle, indent=2, sort_keys=True)
    return path
