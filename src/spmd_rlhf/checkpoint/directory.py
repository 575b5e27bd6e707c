"""The atomic directory protocol of a run's checkpoints: staging and rename, the ``latest`` pointer, retention,
resume resolution, and where each role's state and Hugging Face copy live in a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmd_rlhf.checkpoint.errors import CheckpointError

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


# ---- the directory protocol ------------------------------------------------------------------------------------------


def role_state_dir(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """Where ``role``'s sharded training state lives in a checkpoint."""
    return Path(checkpoint_dir, role + ROLE_STATE_SUFFIX)


def role_hf_dir(checkpoint_dir: str | os.PathLike, role: str) -> Path:
    """Where ``role``'s Hugging Face copy of its weights lives in a checkpoint."""
    return Path(checkpoint_dir, role)


def remove_entry(path: Path) -> None:
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
    ``spmd_rlhf.checkpoint.run_directory``). Then at most ``keep_last`` finished checkpoints stay (0: all;
    ``prune_checkpoints``)."""
    final = Path(checkpoint_dir)
    run_dir = final.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    for leftover in run_dir.glob("*" + STAGING_SUFFIX):
        remove_entry(leftover)
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
