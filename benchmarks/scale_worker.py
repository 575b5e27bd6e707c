"""The rank program of ``benchmarks/scale.py`` (run under torchrun by it, not by hand): a recipe run whose every
process samples its own memory and whose coordinator records when each stage ran.

    torchrun --nproc-per-node 2 benchmarks/scale_worker.py --algo grpo --phase train --record DIR --config YAML k=v...

- Every process runs a sampler thread from its first line on: every ``--interval`` seconds it appends
  (wall-clock time, bytes) — the process's resident set size on CPU (psutil if installed, else /proc/self/statm),
  and on CUDA the peak of ``torch.cuda.max_memory_allocated`` since the previous sample (read, then reset).
- The coordinator (rank 0) runs the recipe through its public methods: ``setup`` (stage ``load``), ``step`` for
  ``trainer.total_steps`` steps, ``save`` (``save``) and each trained role's ``save_pretrained`` (``export``); with
  ``--phase resume`` a fresh ``setup`` plus ``load`` of the checkpoint (``resume``). Inside a step the recipe's own
  ``StageTimer`` names the stages (generate, reward, ref_log_probs, values, update_actor, ...): the subclass below
  gives each step's timer a dict that stamps each stage's wall-clock end as the recipe writes its seconds.
- After the run every rank writes ``<record>/memory_rank<r>.json``, rank 0 also ``<record>/stages.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


class MemorySampler(threading.Thread):
    """(time.time(), bytes) every ``interval`` seconds until ``stop``: resident set size on CPU (what the allocator
    keeps, freed or not: an upper bound on live tensors), allocated bytes' peak since the last sample on CUDA."""

    def __init__(self, *, interval: float, cuda_device: int | None) -> None:
        super().__init__(daemon=True)
        self.interval, self.cuda_device = interval, cuda_device
        self.times: list[float] = []
        self.values: list[int] = []
        self._stopped = threading.Event()
        self._read = self._cuda_peak if cuda_device is not None else _rss_reader()

    def _cuda_peak(self) -> int:
        # Before the rank's first CUDA call the allocator does not exist yet (and nothing is allocated); touching its
        # statistics from this thread must not be what creates the context.
        if not torch.cuda.is_initialized():
            return 0
        peak = torch.cuda.max_memory_allocated(self.cuda_device)
        torch.cuda.reset_peak_memory_stats(self.cuda_device)
        return peak

    def run(self) -> None:
        while not self._stopped.is_set():
            self.times.append(time.time())
            self.values.append(self._read())
            self._stopped.wait(self.interval)

    def stop(self) -> dict:
        """The samples, ending with one taken now: a thread starved of the GIL under load may not have sampled since
        the run's last stage ended, and a record must cover the whole run."""
        self._stopped.set()
        self.join()
        self.times.append(time.time())
        self.values.append(self._read())
        return {"times": self.times, "bytes": self.values}


def _rss_reader() -> Callable[[], int]:
    """This process's resident set size in bytes: psutil if installed, else ``/proc/self/statm``."""
    try:
        import psutil

        process = psutil.Process()
        return lambda: process.memory_info().rss
    except ImportError:
        page = os.sysconf("SC_PAGE_SIZE")

        def from_statm() -> int:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * page

        return from_statm


class _StampedSeconds(dict):
    """A ``StageTimer.seconds`` that also keeps each stage's wall-clock window: every write adds ``new - old``
    seconds ending now, whether the recipe timed a block (``timer(stage)``) or a call (``run_together``)."""

    def __init__(self, seconds: dict[str, float], windows: list[tuple[str, float, float]]) -> None:
        super().__init__(seconds)
        self.windows = windows

    def __setitem__(self, stage: str, seconds: float) -> None:
        end = time.time()
        self.windows.append((stage, end - (seconds - self.get(stage, 0.0)), end))
        super().__setitem__(stage, seconds)


def staged(recipe_class: type) -> type:
    """``recipe_class`` whose steps record their stages' windows in ``self.windows``: each step's timer is first
    handed to ``experience``, which every recipe's step calls before any other timed stage."""

    class Staged(recipe_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.windows: list[tuple[str, float, float]] = []

        def experience(self, step, timer, **also):
            timer.seconds = _StampedSeconds(timer.seconds, self.windows)
            return super().experience(step, timer, **also)

    Staged.__name__ = f"Staged{recipe_class.__name__}"
    return Staged


@contextmanager
def _stage(windows: list[tuple[str, float, float]], name: str) -> Iterator[None]:
    start = time.time()
    yield
    windows.append((name, start, time.time()))


def coordinate(coordinator, *, recipe_class: type, config, phase: str, checkpoint_dir: str, export_dir: str) -> list:
    """The coordinator's program for ``phase`` (train: load, steps, save, export; resume: load from the
    checkpoint); returns the stage windows."""
    recipe = staged(recipe_class)(config, coordinator)
    windows = recipe.windows
    if phase == "resume":
        with _stage(windows, "resume"):
            recipe.setup()
            recipe.load(checkpoint_dir)
        return windows
    with _stage(windows, "load"):
        recipe.setup()
    for step in range(config.trainer.total_steps):
        recipe.step(step)
    with _stage(windows, "save"):
        recipe.save(checkpoint_dir, step=config.trainer.total_steps)
    with _stage(windows, "export"):
        for name in recipe.trained_roles():
            recipe.roles[name].save_pretrained(os.path.join(export_dir, name)).result()
    return windows


def main() -> None:
    sampler = MemorySampler(
        interval=float(os.environ.get("SCALE_SAMPLE_INTERVAL", "0.005")),
        cuda_device=int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.is_available() else None,
    )
    sampler.start()
    parser = argparse.ArgumentParser(description="rank program of benchmarks/scale.py")
    parser.add_argument("--algo", required=True, choices=["grpo", "ppo"])
    parser.add_argument("--phase", required=True, choices=["train", "resume"])
    parser.add_argument("--record", required=True, help="directory for the samples and stage windows")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--export", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from spmd_rlhf.config import load_config
    from spmd_rlhf.recipes.grpo import GRPORecipe
    from spmd_rlhf.recipes.ppo import PPORecipe
    from spmd_rlhf.runtime import RuntimeOptions, launch

    config = load_config(args.config, args.overrides)
    recipe_class = {"grpo": GRPORecipe, "ppo": PPORecipe}[args.algo]
    timeout = config.trainer.timeout_s
    windows = launch(
        lambda coordinator: coordinate(
            coordinator,
            recipe_class=recipe_class,
            config=config,
            phase=args.phase,
            checkpoint_dir=args.checkpoint,
            export_dir=args.export,
        ),
        options=RuntimeOptions(call_timeout_s=timeout, collective_timeout_s=timeout),
    )
    record, rank = Path(args.record), int(os.environ.get("RANK", "0"))
    record.mkdir(parents=True, exist_ok=True)
    (record / f"memory_rank{rank}.json").write_text(json.dumps(sampler.stop()))
    if rank == 0:
        (record / "stages.json").write_text(json.dumps(windows))
    # As the recipes' own entry point: skip interpreter teardown, where a C++ thread of the distributed stack left
    # joinable can abort a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
