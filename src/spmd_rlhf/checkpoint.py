"""Checkpoints: the atomic directory protocol, resume resolution, each trained role's sharded state (DCP), and the
export of a role's weights as a Hugging Face directory from that state alone.

A run directory (``trainer.output_dir``) holds checkpoints and a pointer to the newest one:

    <run>/step_4/trainer_state.json   {"step": 4, "recipe": "grpo"}, written last, before the rename
    <run>/step_4/actor_state/         DCP shards: model, optimizer, LR schedule, each rank's RNG state
    <run>/step_4/actor_state/hf_config/   config.json, tokenizer files, role.json: what export needs besides weights
    <run>/step_4/actor/               the same weights as a Hugging Face directory (trainer.save_hf: by default
                                      only in the final checkpoint), streamed from the shards
    <run>/step_4/config.yaml          the resolved config the run had when it saved
    <run>/latest                      "step_4"

A checkpoint is written under ``step_4.tmp`` and renamed when whole; ``latest`` is replaced last. A crash at any point
leaves the previous checkpoint and ``latest`` as they were; ``*.tmp`` leftovers are never resumed from and are removed
by the next save. The small files and the run directory are fsynced, so a power loss cannot leave ``latest`` naming a
checkpoint whose rename was lost. Retention (``keep_last``) renames an old checkpoint to a ``*.tmp`` name before
deleting it, so a crash mid-delete leaves a leftover, never a half-deleted checkpoint that looks finished. Export runs
in one process, with no process group, whatever layout wrote the shards, a bucket of tensors at a time:

    spmd-rlhf export outputs/grpo hf_out --roles actor critic
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from spmd_rlhf import safe_dcp
from spmd_rlhf.models import DecoderArgs, DecoderLM, read_decoder_args
from spmd_rlhf.models.safetensors_stream import SafetensorsWriter, TensorEntry, plan_files, split_by_bytes, write_index
from spmd_rlhf.models.weights import write_hf_metadata
from spmd_rlhf.safe_dcp import CheckpointError

TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
"""The resolved config, in each checkpoint and at the top of the run directory."""
LATEST = "latest"
STAGING_SUFFIX = ".tmp"
ROLE_STATE_SUFFIX = "_state"
HF_CONFIG = "hf_config"
"""Subdirectory of a role's state holding its model config, tokenizer and ``role.json`` (the model head)."""
ROLE_FILE = "role.json"
LORA_FILE = "lora.json"
"""In ``HF_CONFIG`` of a role that trains LoRA adapters: their PEFT adapter config, naming the base model."""
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""A role's saved model state: its trained parameters (all of them, or with LoRA the adapters and a critic's head;
the frozen base is read again from its model directory)."""
LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading that state leaves the frozen parameters as loaded from the model directory (``_check_model_shapes``
has checked that every trained one is in the checkpoint)."""


# ---- the directory protocol ------------------------------------------------------------------------------------------


def role_state_dir(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """Where ``role``'s sharded training state lives in a checkpoint."""
    return Path(checkpoint_dir, role + ROLE_STATE_SUFFIX)


def role_hf_dir(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """Where ``role``'s Hugging Face copy of its weights lives in a checkpoint."""
    return Path(checkpoint_dir, role)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_small_file(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a ``*.tmp`` sibling that is fsynced and renamed over it, then fsync the
    directory: after a crash ``path`` holds the old text or the new, never a part."""
    path = Path(path)
    staging = path.with_name(path.name + STAGING_SUFFIX)
    with staging.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    staging.replace(path)
    fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the renames and deletions in ``directory`` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_checkpoint(
    checkpoint_dir: str | os.PathLike,
    write_contents: Callable[[Path], None],
    *,
    trainer_state: dict[str, Any],
    config_yaml: str | None = None,
    keep_last: int = 0,
) -> Path:
    """Write a checkpoint atomically: ``write_contents(staging_dir)`` fills ``<checkpoint_dir>.tmp``, then
    ``config.yaml`` (the resolved config, when given) and ``trainer_state.json`` go in, the directory is renamed to
    ``checkpoint_dir``, and ``<parent>/latest`` is replaced to name it. Leftover ``*.tmp`` entries of crashed saves in
    the run directory are removed first (only the job holding the run directory's lock saves into it:
    ``spmd_rlhf.run_directory``). Then at most ``keep_last`` finished checkpoints stay (0: all;
    ``prune_checkpoints``)."""
    final = Path(checkpoint_dir)
    run_dir = final.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    for leftover in run_dir.glob("*" + STAGING_SUFFIX):
        _remove(leftover)
    staging = final.with_name(final.name + STAGING_SUFFIX)
    staging.mkdir()
    write_contents(staging)
    if config_yaml is not None:
        write_small_file(staging / CONFIG_FILE, config_yaml)
    write_small_file(staging / TRAINER_STATE, json.dumps(trainer_state))
    # A directory cannot be renamed over a non-empty one: an older checkpoint of the same name is moved aside (to a
    # *.tmp name, so it is never resumed from) and deleted once the new one is in place and named by latest.
    replaced = final.with_name(final.name + ".replaced" + STAGING_SUFFIX)
    if final.exists():
        final.rename(replaced)
    staging.rename(final)
    fsync_dir(run_dir)
    write_small_file(run_dir / LATEST, final.name)
    if replaced.exists():
        shutil.rmtree(replaced)
    if keep_last:
        prune_checkpoints(run_dir, keep_last)
    return final


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` finished checkpoints of highest step, never the one ``latest`` names; returns
    the deleted ones. Each is first renamed to a ``*.tmp`` name (so a crash mid-delete leaves a leftover the next save
    removes, not a damaged checkpoint), then removed."""
    run_dir = Path(run_dir)
    named = latest_checkpoint(run_dir)
    finished = sorted(
        (path for path in run_dir.glob("*") if is_checkpoint(path)),
        key=lambda path: read_trainer_state(path)["step"],
        reverse=True,
    )
    deleted = []
    for path in finished[keep_last:]:
        if named is not None and path.resolve() == named.resolve():
            continue
        doomed = path.with_name(path.name + ".deleted" + STAGING_SUFFIX)
        path.rename(doomed)
        fsync_dir(run_dir)
        shutil.rmtree(doomed)
        deleted.append(path)
    return deleted


def save_due(
    steps_done: int, *, total_steps: int, save_every: int, minutes_since_save: float, save_every_minutes: float
) -> bool:
    """Whether the run saves after ``steps_done`` steps: after the last, every ``save_every`` steps (0: never by
    count), and once ``save_every_minutes`` have passed since the previous save (0: never by time)."""
    return (
        steps_done == total_steps
        or (save_every > 0 and steps_done % save_every == 0)
        or (save_every_minutes > 0 and minutes_since_save >= save_every_minutes)
    )


def hf_copy_due(save_hf: str, *, last: bool) -> bool:
    """Whether a checkpoint also gets the trained roles' Hugging Face copies under ``trainer.save_hf``: ``every``
    save, only the ``final`` one (after the last step), or ``never``."""
    return save_hf == "every" or (save_hf == "final" and last)


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A finished checkpoint: a directory with ``trainer_state.json`` whose name is not a staging name."""
    path = Path(path)
    return not path.name.endswith(STAGING_SUFFIX) and (path / TRAINER_STATE).is_file()


def read_trainer_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer_state.json`` of a finished checkpoint (``step``, ``recipe``)."""
    if not is_checkpoint(checkpoint_dir):
        raise CheckpointError(
            f"{checkpoint_dir} is not a checkpoint (no {TRAINER_STATE}, or an unfinished *{STAGING_SUFFIX} save)"
        )
    return json.loads(Path(checkpoint_dir, TRAINER_STATE).read_text())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``<run_dir>/latest`` names; if it is missing or names no finished checkpoint (a crash between
    a rename and the pointer update), the finished checkpoint with the highest step; None if there is none."""
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    if pointer.is_file():
        named = run_dir / pointer.read_text().strip()
        if is_checkpoint(named):
            return named
    finished = [path for path in run_dir.glob("*") if is_checkpoint(path)] if run_dir.is_dir() else []
    return max(finished, key=lambda path: read_trainer_state(path)["step"], default=None)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint, else the latest checkpoint of ``path`` as a run directory."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"{path} is neither a checkpoint (no {TRAINER_STATE}) nor a run directory holding one")
    return found


def checkpoint_roles(checkpoint_dir: str | os.PathLike) -> list[str]:
    """The roles whose training state a checkpoint holds."""
    paths = Path(checkpoint_dir).glob("*" + ROLE_STATE_SUFFIX)
    return sorted(path.name[: -len(ROLE_STATE_SUFFIX)] for path in paths if path.is_dir())


def require_role_state(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """``role``'s state directory in the checkpoint, or an error naming the roles it does hold."""
    state_dir = role_state_dir(checkpoint_dir, role)
    if not (state_dir / ".metadata").is_file():
        held = ", ".join(checkpoint_roles(checkpoint_dir)) or "none"
        raise CheckpointError(f"{checkpoint_dir} holds no {role} state (roles in it: {held})")
    return state_dir


# ---- a role's sharded training state ---------------------------------------------------------------------------------


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _rng_key(process_group: dist.ProcessGroup | None) -> str:
    # One key per rank: DCP keeps one copy of a key that several ranks save, and the RNG states differ by rank.
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    return f"rng_rank{rank}"


def save_role_state(
    state_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Save model, optimizer, LR schedule and this rank's RNG state with DCP (collective over ``process_group``, which
    must span every rank of the role): each rank writes its own shards."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        _rng_key(process_group): _rng_state(),
    }
    dcp.save(state, checkpoint_id=str(state_dir), process_group=process_group)


def load_role_state(
    state_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Restore what ``save_role_state`` wrote, resharded to this layout (any DP size). A rank restores its RNG state
    when the saving job had a rank of that index (and the same devices); otherwise it keeps its own."""
    _create_optimizer_state(optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict()}
    rng_key = _rng_key(process_group)
    saved = safe_dcp.read_metadata(state_dir).state_dict_metadata
    _check_model_shapes(state_dir, model_state, saved)
    rng = {device: tensor for device, tensor in _rng_state().items() if f"{rng_key}.{device}" in saved}
    if rng:
        state[rng_key] = rng
    safe_dcp.load(state, state_dir, process_group=process_group)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=LOAD_TRAINED_ONLY,
    )
    scheduler.load_state_dict(state["scheduler"])
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


@torch.no_grad()
def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (DCP loads into existing tensors), one parameter at a time: a step with a
    zero gradient and the learning rate at 0 changes no weight. ``get_state_dict`` would do it with a zero gradient
    for every parameter at once, one whole gradient shard of transient memory on top of the weights and moments."""
    if optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
                    optimizer.step()
                    param.grad = None
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate


def _check_model_shapes(state_dir: str | os.PathLike, model_state: dict[str, Any], saved: dict[str, Any]) -> None:
    """One error naming the tensors whose saved shapes differ from this model's (or that it lacks), before DCP's
    own per-rank errors: the checkpoint is of another model."""
    problems = []
    for name, tensor in model_state.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{name} missing")
        elif tuple(entry.size) != tuple(tensor.shape):
            problems.append(f"{name} {list(entry.size)} saved, {list(tensor.shape)} here")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")
        raise CheckpointError(
            f"{state_dir} holds another model ({shown}); resume with the model it was trained from (model.path), "
            f"or start fresh with trainer.resume=null or another trainer.output_dir"
        )


def save_model_config(
    state_dir: str | os.PathLike, model: DecoderLM, *, tokenizer_path: str, adapter_config: dict | None = None
) -> None:
    """Write what rebuilds ``model`` without its original directory (HF config, tokenizer, head; with LoRA the
    adapter config naming the base model, whose weights the checkpoint does not hold) into the role's state; one
    rank of the role calls it."""
    from transformers import AutoTokenizer

    config_dir = Path(state_dir, HF_CONFIG)
    config_dir.mkdir(parents=True, exist_ok=True)
    model.args.hf_config.save_pretrained(config_dir)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(config_dir)
    (config_dir / ROLE_FILE).write_text(json.dumps({"head": model.head}))
    if adapter_config is not None:
        (config_dir / LORA_FILE).write_text(json.dumps(adapter_config, indent=2))


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
    saved = safe_dcp.read_metadata(state_dir).state_dict_metadata
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
            safe_dcp.load({"model": tensors}, state_dir, no_dist=True)
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
        _remove(entry)


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
    the adapters merged into the base read from its model directory (``lora_export``)."""
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
            from spmd_rlhf.lora_export import export_lora

            export_lora(config_dir, role_dir, merge=merge, dtype=dtype, max_shard_bytes=max_shard_bytes)
            continue
        _, args, head, saved = _role_model_entries(checkpoint_dir, role)
        entries = [TensorEntry(name, tuple(entry.size), dtype) for name, entry in saved.items()]
        files = plan_files([entries], max_shard_bytes=max_shard_bytes)
        buckets = read_role_tensors(checkpoint_dir, role, bucket_bytes=bucket_bytes)
        bucket: dict[str, torch.Tensor] = {}
        for planned in files:
            with SafetensorsWriter(role_dir, planned) as file:
                for entry in planned.entries:
                    if entry.name not in bucket:
                        bucket = {}  # dropped before the next is read
                        bucket = next(buckets)
                    # Popped, so each tensor goes as soon as it is written (the reader holds the same dict).
                    file.write(bucket.pop(entry.name).to(dtype))
        write_index(role_dir, files)
        write_hf_metadata(
            role_dir, args, head=head, dtype=dtype, tokenizer=AutoTokenizer.from_pretrained(str(config_dir))
        )
    return written
