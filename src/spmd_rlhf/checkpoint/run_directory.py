"""A run directory (``trainer.output_dir``) belongs to one run at a time: its lock, its resolved config, and the
checks that decide whether a new launch may continue the checkpoint in it.

    <run>/.lock          flock-ed by the coordinator for the whole run; holds the holder's host, pid and SLURM job id
    <run>/config.yaml    the resolved config of the latest launch (each checkpoint keeps its own copy)
    <run>/stopped.json   written when a run stopped on SIGTERM/SIGUSR1 after saving (recipes/slurm/train.sbatch
                         requeues the job when it finds it)

A launch continues a checkpoint only when its config keeps the data order and the model (``RESUME_FIXED_KEYS``),
unless ``trainer.resume_allow_changes=true``; a run directory whose checkpoint already reached ``trainer.total_steps``
is refused instead of running zero steps.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, TextIO

import yaml

from spmd_rlhf.checkpoint import CONFIG_FILE, CheckpointError, read_trainer_state, writable_dir, write_small_file

LOCK_FILE = ".lock"
STOPPED_FILE = "stopped.json"
RESUME_FIXED_KEYS = (
    "data.train_files",
    "data.shuffle",
    "data.seed",
    "data.batch_size",
    "data.prompt_key",
    "model.path",
    "model.tokenizer_path",
    "critic.model_path",
    "cost_critic.model_path",
)
"""Keys whose change makes a resumed run another run: the order and batching of the prompts, and the models trained
(their architecture comes from their directories)."""


class RunDirectoryError(CheckpointError):
    """The run directory is held by another job, or its checkpoint does not fit this launch."""


class RunLock:
    """An exclusive ``flock`` on ``<run>/.lock`` for as long as the run goes on (released at exit, whatever the exit).
    ``acquire`` fails at once, naming the holder, when another process holds it: two jobs saving into one directory
    would delete each other's staging directories and interleave ``latest``."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir, LOCK_FILE)
        self._file: TextIO | None = None

    def acquire(self) -> None:
        try:  # the run directory is created here, first thing: say at once if it cannot be
            writable_dir(self.path.parent)
        except CheckpointError as error:
            raise CheckpointError(f"trainer.output_dir: {error}") from None
        handle = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RunDirectoryError(
                f"trainer.output_dir={self.path.parent} is in use by {holder}; wait for that run to end, stop it, or "
                f"use another trainer.output_dir"
            ) from None
        except OSError as error:  # e.g. Lustre mounted without -o flock
            handle.close()
            raise RunDirectoryError(
                f"cannot lock {self.path} ({error.strerror or error}): the filesystem of trainer.output_dir does not "
                f"support flock; mount it with flock support or use another trainer.output_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        job = os.environ.get("SLURM_JOB_ID")
        handle.write(f"host {socket.gethostname()}, pid {os.getpid()}" + (f", SLURM job {job}" if job else "") + "\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def write_run_config(run_dir: str | os.PathLike, config_yaml: str) -> None:
    """``<run>/config.yaml``: the resolved config of this launch."""
    write_small_file(Path(run_dir, CONFIG_FILE), config_yaml)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return flat


def config_changes(saved_yaml: str, current_yaml: str) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every leaf key whose value differs between two resolved configs."""
    saved, current = _flatten(yaml.safe_load(saved_yaml)), _flatten(yaml.safe_load(current_yaml))
    keys = sorted(set(saved) | set(current))
    return {key: (saved.get(key), current.get(key)) for key in keys if saved.get(key) != current.get(key)}


def check_resume(
    checkpoint_dir: str | os.PathLike, *, config_yaml: str, total_steps: int, allow_changes: bool
) -> dict[str, tuple[Any, Any]]:
    """Refuse to continue ``checkpoint_dir`` when this launch's config changes a ``RESUME_FIXED_KEYS`` key (unless
    ``allow_changes``) or when the checkpoint already reached ``total_steps``; returns every changed key (for the
    notice a resume prints). A checkpoint saved without its config is only checked for its step."""
    checkpoint_dir = Path(checkpoint_dir)
    step = int(read_trainer_state(checkpoint_dir)["step"])
    saved = checkpoint_dir / CONFIG_FILE
    changes = config_changes(saved.read_text(), config_yaml) if saved.is_file() else {}
    fixed = {key: values for key, values in changes.items() if key in RESUME_FIXED_KEYS}
    if fixed and not allow_changes:
        shown = "; ".join(f"{key}: {saved_value!r} saved, {value!r} now" for key, (saved_value, value) in fixed.items())
        raise RunDirectoryError(
            f"{checkpoint_dir} was trained with another data order or model ({shown}); resume with the saved values, "
            "start a new run with another trainer.output_dir, "
            "or set trainer.resume_allow_changes=true to resume anyway"
        )
    if step >= total_steps:
        raise RunDirectoryError(
            f"{checkpoint_dir} already reached step {step} and trainer.total_steps={total_steps}: nothing to run. "
            f"To train on from it raise trainer.total_steps above {step}; to start a new run use another "
            f"trainer.output_dir"
        )
    return changes


def check_fresh_start(run_dir: str | os.PathLike, latest: Path | None) -> None:
    """With ``trainer.resume=null`` a run starts from step 0; refuse it in a directory holding another run's
    checkpoints, which its saves would overwrite and its retention delete."""
    if latest is not None:
        raise RunDirectoryError(
            f"trainer.resume=null, but trainer.output_dir={run_dir} holds an earlier run's checkpoints (latest "
            f"{latest.name}); use another trainer.output_dir, remove that directory, or resume it with "
            f"trainer.resume=auto"
        )


def mark_stopped(run_dir: str | os.PathLike, *, reason: str, step: int) -> None:
    """``<run>/stopped.json``: the run stopped early on a signal, with its checkpoint at ``step`` saved."""
    write_small_file(Path(run_dir, STOPPED_FILE), json.dumps({"reason": reason, "step": step, "time": time.time()}))


def clear_stopped(run_dir: str | os.PathLike) -> None:
    Path(run_dir, STOPPED_FILE).unlink(missing_ok=True)
