"""A role's weights as a Hugging Face directory, streamed from its DCP state alone in one process, a bucket of
tensors at a time, whatever layout wrote the shards."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from spmd_rlhf.checkpoint import safe_load
from spmd_rlhf.checkpoint.directory import (
    HF_CONFIG,
    LORA_FILE,
    ROLE_FILE,
    remove_entry,
    require_role_state,
    resolve_checkpoint,
    role_hf_dir,
)
from spmd_rlhf.checkpoint.errors import CheckpointError
from spmd_rlhf.models import DecoderArgs, DecoderLM, read_decoder_args
from spmd_rlhf.models.checkpoint_names import checkpoint_layout
from spmd_rlhf.models.safetensors_stream import SafetensorsWriter, TensorEntry, plan_files, split_by_bytes, write_index
from spmd_rlhf.models.weights import write_hf_metadata

# ---- export ----------------------------------------------------------------------------------------------------------


def role_config_dir(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """The directory ``save_model_config`` wrote for ``role`` in a checkpoint, or an error saying what is missing."""
    config_dir = require_role_state(checkpoint_dir, role) / HF_CONFIG
    if not (config_dir / ROLE_FILE).is_file():
        raise CheckpointError(
            f"{config_dir.parent} has no {HF_CONFIG}/{ROLE_FILE} (written before export existed); "
            f"use the Hugging Face copy in {role_hf_dir(checkpoint_dir, role)}"
        )
    return config_dir


def _role_model_entries(
    checkpoint_dir: str | os.PathLike, role: str
) -> tuple[Path, DecoderArgs, str, dict[str, TensorStorageMetadata]]:
    """(state directory, model args, head, each parameter's saved tensor metadata in model order) of ``role``."""
    config_dir = role_config_dir(checkpoint_dir, role)
    state_dir = config_dir.parent
    head = json.loads((config_dir / ROLE_FILE).read_text())["head"]
    args = read_decoder_args(str(config_dir))
    with torch.device("meta"):
        names = [name for name, _ in DecoderLM(args, head=head).named_parameters()]
    saved = safe_load.read_metadata(state_dir).state_dict_metadata
    entries = {name: saved.get(f"model.{name}") for name in names}
    missing = [name for name, entry in entries.items() if not isinstance(entry, TensorStorageMetadata)]
    if missing:
        raise CheckpointError(f"{state_dir} lacks model tensors {', '.join(missing)}; the checkpoint is incomplete")
    return state_dir, args, head, entries


def read_role_tensors(
    checkpoint_dir: str | os.PathLike, role: str, *, bucket_bytes: int = 1024**3
) -> Iterator[dict[str, torch.Tensor]]:
    """``role``'s saved weights (float32 master weights of a trained role), read in this process alone from the DCP
    shards of any layout, as buckets of consecutive tensors of at most ``bucket_bytes`` as saved (a larger tensor
    is a bucket of its own), in model order. At peak this holds one bucket plus one saved chunk being copied in."""
    state_dir, _, _, saved = _role_model_entries(checkpoint_dir, role)
    entries = [TensorEntry(name, tuple(entry.size), entry.properties.dtype) for name, entry in saved.items()]
    for bucket in split_by_bytes(entries, bucket_bytes):
        tensors = {entry.name: torch.empty(entry.shape, dtype=entry.dtype) for entry in bucket}
        with warnings.catch_warnings():
            # DCP warns that it loads in a single process even when asked to with no_dist: that is the intent here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_load.load({"model": tensors}, state_dir, no_dist=True)
        yield tensors
        del tensors


def writable_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir``, created if missing, once a file could be written in it; else an error naming it and why."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise CheckpointError(f"cannot write to {out}: {error.strerror or error}") from error
    return out


def _empty_export_target(out: Path, checkpoint_dir: Path, *, overwrite: bool) -> None:
    """Refuse a non-empty export target, or empty it under ``overwrite`` (never one holding the checkpoint)."""
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise CheckpointError(
            f"{out} is not empty; export into a new or empty directory, or pass --overwrite to empty it first"
        )
    if out.resolve() in (checkpoint_dir.resolve(), *checkpoint_dir.resolve().parents):
        raise CheckpointError(f"{out} holds the checkpoint {checkpoint_dir} being exported; export somewhere else")
    for entry in out.iterdir():
        remove_entry(entry)


def export_hf(
    checkpoint_or_run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    roles: Iterable[str] = ("actor",),
    *,
    dtype: torch.dtype = torch.float32,
    bucket_bytes: int = 1024**3,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
    merge: bool = False,
) -> dict[str, Path]:
    """Write each role's weights from a checkpoint (or a run directory's latest) as a Hugging Face directory
    ``<out_dir>/<role>`` with its tokenizer, in ``dtype`` (float32: the master weights as trained); returns
    ``{role: directory}``. Every role is checked before any is written. A non-empty ``out_dir`` is refused unless
    ``overwrite``, which empties it first: shards or an index left from an earlier export would be loaded with the
    new ones.

    Streams: at peak this holds one bucket of ``bucket_bytes`` of saved tensors (or one tensor when it is larger),
    one saved chunk being read and one tensor converted to ``dtype``; never the whole model.

    A role that trained LoRA adapters is written as a PEFT adapter directory, or with ``merge`` as a full model with
    the adapters merged into the base read from its model directory (``checkpoint.peft_export``)."""
    from transformers import AutoTokenizer

    checkpoint_dir = resolve_checkpoint(checkpoint_or_run_dir)
    config_dirs = {role: role_config_dir(checkpoint_dir, role) for role in roles}
    _empty_export_target(Path(out_dir), checkpoint_dir, overwrite=overwrite)
    out = writable_dir(out_dir)
    written = {}
    for role, config_dir in config_dirs.items():
        role_dir = out / role
        role_dir.mkdir(exist_ok=True)
        written[role] = role_dir
        if (config_dir / LORA_FILE).is_file():
            from spmd_rlhf.checkpoint.peft_export import export_lora

            export_lora(config_dir, role_dir, merge=merge, dtype=dtype, max_shard_bytes=max_shard_bytes)
            continue
        _, args, head, saved = _role_model_entries(checkpoint_dir, role)
        # Written as published (``checkpoint_names``): an expert parameter one tensor per expert.
        layout = checkpoint_layout(args.family, {name: tuple(entry.size) for name, entry in saved.items()})
        stored = {part.name: part for parts in layout.values() for part in parts}
        entries = [TensorEntry(name, part.shape, dtype) for name, part in stored.items()]
        files = plan_files([entries], max_shard_bytes=max_shard_bytes)
        buckets = read_role_tensors(checkpoint_dir, role, bucket_bytes=bucket_bytes)
        bucket: dict[str, torch.Tensor] = {}
        for planned in files:
            with SafetensorsWriter(role_dir, planned) as file:
                for entry in planned.entries:
                    part = stored[entry.name]
                    if part.parameter not in bucket:
                        bucket = {}  # dropped before the next is read
                        bucket = next(buckets)
                    if part.expert is None or part.expert == layout[part.parameter][-1].expert:
                        # Popped after its last tensor, so each parameter goes as soon as it is written (the reader
                        # holds the same dict).
                        tensor = bucket.pop(part.parameter)
                    else:
                        tensor = bucket[part.parameter]
                    file.write((tensor if part.expert is None else tensor[part.expert]).to(dtype))
        write_index(role_dir, files)
        write_hf_metadata(
            role_dir, args, head=head, dtype=dtype, tokenizer=AutoTokenizer.from_pretrained(str(config_dir))
        )
    return written
