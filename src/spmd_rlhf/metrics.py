"""Step metrics: stage timers, the JSONL sink (``<output_dir>/metrics.jsonl``, one object per step) and a console
progress bar with ETA and the key numbers."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

CONSOLE_KEYS = (("reward/mean", "reward"), ("response_length/mean", "len"), ("kl/mean", "kl"), ("actor/entropy", "entropy"))


class StageTimer:
    """Wall-clock seconds per named stage of one step, as ``time/<stage>`` metrics."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{stage}": seconds for stage, seconds in self.seconds.items()}


def mean_over_ranks(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average the metric dicts that each DP rank of a role returned."""
    keys = {key for metrics in per_rank for key in metrics}
    return {key: sum(m[key] for m in per_rank if key in m) / sum(1 for m in per_rank if key in m) for key in sorted(keys)}


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Writes each step's metrics to the configured sinks (``console`` and ``jsonl``)."""

    def __init__(self, output_dir: str, *, loggers: Sequence[str], total_steps: int, stream=None) -> None:
        self.loggers = set(loggers)
        unsupported = self.loggers - {"console", "jsonl"}
        if unsupported:
            raise ValueError(f"trainer.loggers: {sorted(unsupported)} are not available yet; use console and jsonl")
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self._started = time.perf_counter()
        self._first_step: int | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        if "jsonl" in self.loggers:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if "console" in self.loggers:
            self.stream.write(self.progress_line(step, metrics) + "\n")
            self.stream.flush()

    def progress_line(self, step: int, metrics: dict[str, float]) -> str:
        """``step 3/20 [###-------] 15% | reward 0.412 | len 3.1 | 1.20 s/step | ETA 0:00:20``"""
        if self._first_step is None:
            self._first_step = step
        done = step + 1
        elapsed = time.perf_counter() - self._started
        per_step = elapsed / max(1, done - self._first_step)
        width = 20
        filled = width * done // self.total_steps
        parts = [f"step {done}/{self.total_steps} [{'#' * filled}{'-' * (width - filled)}] {100 * done // self.total_steps:3d}%"]
        parts += [f"{label} {metrics[key]:.3g}" for key, label in CONSOLE_KEYS if key in metrics]
        parts += [f"{per_step:.2f} s/step", f"ETA {format_duration(per_step * (self.total_steps - done))}"]
        return " | ".join(parts)
