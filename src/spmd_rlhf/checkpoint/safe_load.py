"""Reading DCP checkpoints without running code from them.

DCP's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with full ``pickle``, and its load planner reads
non-tensor items (the optimizer's hyperparameters, the LR schedule's counters) with ``torch.load(weights_only=False)``:
a crafted file in a run directory would run code in every process that resumes or exports from it. Here the metadata
goes through an unpickler that admits only the classes DCP's metadata is made of, and non-tensor items through
``torch.load(weights_only=True)`` (plain containers and numbers, which is all our state holds). Anything else is a
``CheckpointError`` naming the file. Tensor shards were already read with ``weights_only=True`` by DCP itself.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from spmd_rlhf.checkpoint.errors import CheckpointError

METADATA_FILE = ".metadata"

_ADMITTED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    # StorageMeta.checkpoint_id is the path the checkpoint was saved under (pathlib._local from Python 3.13).
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}
"""(module, name) pairs DCP's metadata pickles reference (torch 2.11 to 2.13), besides ``torch.<dtype>``; each
builds plain data, nothing that runs a command."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self._path} references {module}.{name}, which DCP checkpoint metadata never holds; the file was not "
            f"written by DCP (or was altered) and is not loaded. Resume or export only checkpoints your own jobs wrote"
        )


def read_metadata(state_dir: str | os.PathLike) -> Metadata:
    """The DCP metadata of ``state_dir``, read without running code from it."""
    path = Path(state_dir, METADATA_FILE)
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, str(path)).load()
    except CheckpointError:
        raise
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror or error}") from error
    except Exception as error:
        raise CheckpointError(f"{path} is not readable DCP metadata ({type(error).__name__}: {error})") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        _check_confined(getattr(info, "relative_path", None), path)
    return metadata


def _check_confined(relative_path: Any, metadata_path: Path) -> None:
    """A storage file of the metadata must be a plain file name inside the checkpoint's directory: DCP writes
    ``__<rank>_<n>.distcp`` beside ``.metadata``; an absolute or ``..`` path would read any file of the machine."""
    name = str(relative_path)
    inside = (
        isinstance(relative_path, str)
        and name not in ("", ".", "..")
        and not os.path.isabs(name)
        and ".." not in Path(name).parts
        and "\\" not in name
    )
    if not inside:
        raise CheckpointError(
            f"{metadata_path} points a shard at {name!r}, outside the checkpoint's directory; the file was not "
            f"written by DCP (or was altered) and is not loaded. Resume or export only checkpoints your own jobs wrote"
        )


class _Reader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Our checkpoints have one .metadata (no per-rank files), whichever rank asks.
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(DefaultLoadPlanner):
    def __init__(self, state_dir: str) -> None:
        super().__init__()
        self._state_dir = state_dir

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes, with weights_only=True.
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            reason = str(error).splitlines()[0]
            raise CheckpointError(
                f"{fqn} in {self._state_dir} is not plain data ({reason}); the checkpoint was not written by "
                f"spmd_rlhf (or was altered) and is not loaded"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(
    state: dict[str, Any],
    state_dir: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    """``dcp.load`` of ``state`` from ``state_dir`` (in place, resharded), reading no code from the files. A refusal
    is raised as the ``CheckpointError`` naming it, not inside DCP's ``CheckpointException`` (a ``BaseException``
    that carries every rank's traceback)."""
    read_metadata(state_dir)  # DCP would fold a refusal of its metadata into an AssertionError of its own
    try:
        dcp.load(
            state,
            storage_reader=_Reader(str(state_dir)),
            planner=_Planner(str(state_dir)),
            process_group=process_group,
            no_dist=no_dist,
        )
    except CheckpointException as error:
        refusals = [failure for failure, _ in error.failures.values() if isinstance(failure, CheckpointError)]
        if refusals:
            raise refusals[0] from None
        raise
