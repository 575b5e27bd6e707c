"""Where each step's metrics go: the console, ``metrics.jsonl``, TensorBoard and wandb (``trainer.loggers``).

Every sink has ``log(step, metrics)`` and ``close()``. ``build_sinks`` makes the configured ones on the coordinator at
the start of a run, so a sink whose optional package is missing fails before any model loads, with the ``pip
install`` that fixes it.

- ``console``: a progress line per logged step (``step 3/20 [###---] 15% | reward 0.412 | ... | ETA 0:00:20``) and,
  every ``trainer.timing_every`` steps and after the last, a table of each stage's mean seconds and share of the step.
- ``jsonl``: one JSON object per logged step in ``<output_dir>/metrics.jsonl`` (what ``spmd-rlhf plot`` reads).
- ``tensorboard``: scalars under ``<output_dir>/tensorboard`` (``tensorboard --logdir <output_dir>/tensorboard``).
- ``wandb``: a run in ``trainer.wandb_project`` whose local files go under ``<output_dir>/wandb``;
  ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from spmd_rlhf.config import TrainerConfig

CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("response_length/mean", "len"),
    ("kl/mean", "kl"),
    ("actor/entropy", "entropy"),
    ("perf/mfu", "mfu"),
)
"""(metric, label) pairs the progress line shows when a step has them."""


class Sink(Protocol):
    """A destination of step metrics."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def format_duration(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ConsoleSink:
    """The progress line with ETA and key metrics, and every ``timing_every`` steps (0: never) and after the last step
    a table of the stage times (``time/<stage>``) averaged over the steps logged since the previous table."""

    def __init__(self, *, total_steps: int, timing_every: int, stream: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.timing_every = timing_every
        self.stream = stream or sys.stdout
        self._started: float | None = None
        self._first_step = 0
        self._window: list[tuple[int, dict[str, float]]] = []
        self._next_table = timing_every

    def log(self, step: int, metrics: dict[str, float]) -> None:
        lines = [self.progress_line(step, metrics)]
        if self.timing_every:
            self._window.append((step, {key: value for key, value in metrics.items() if key.startswith("time/")}))
            if step + 1 >= self._next_table or step + 1 == self.total_steps:
                lines.append(self.timing_table())
                self._window = []
                self._next_table = (step + 1) // self.timing_every * self.timing_every + self.timing_every
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()

    def progress_line(self, step: int, metrics: dict[str, float]) -> str:
        """``step 3/20 [###-------] 15% | reward 0.412 | len 3.1 | 1.20 s/step | ETA 0:00:20``"""
        if self._started is None:
            # The clock starts when the first logged step started, not when the run set up its models.
            self._started = time.perf_counter() - metrics.get("time/step", 0.0)
            self._first_step = step
        done = step + 1
        per_step = (time.perf_counter() - self._started) / (done - self._first_step)
        width = 20
        filled = width * done // self.total_steps
        parts = [
            f"step {done}/{self.total_steps} [{'#' * filled}{'-' * (width - filled)}] "
            f"{100 * done // self.total_steps:3d}%"
        ]
        parts += [f"{label} {metrics[key]:.3g}" for key, label in CONSOLE_KEYS if key in metrics]
        parts += [f"{per_step:.2f} s/step", f"ETA {format_duration(per_step * (self.total_steps - done))}"]
        return " | ".join(parts)

    def timing_table(self) -> str:
        """Each stage's mean seconds over the window's steps (0 for a step without it) and its share of the mean
        ``time/step``, slowest first. A stage outside the step (``validate``) can make the shares sum past 100%."""
        steps = [step for step, _ in self._window]
        totals: dict[str, float] = {}
        for _, times in self._window:
            for key, seconds in times.items():
                stage = key.removeprefix("time/")
                totals[stage] = totals.get(stage, 0.0) + seconds
        means = {stage: total / len(steps) for stage, total in totals.items()}
        step_seconds = means.pop("step", 0.0)
        span = f"step {steps[0] + 1}" if len(steps) == 1 else f"steps {steps[0] + 1}-{steps[-1] + 1}"
        width = max([len("step"), *map(len, means)])
        lines = [f"stage times, mean of {len(steps)} logged {span}:"]
        for stage, seconds in [*sorted(means.items(), key=lambda item: -item[1]), ("step", step_seconds)]:
            share = f"{100 * seconds / step_seconds:6.1f}%" if step_seconds else ""
            lines.append(f"  {stage:<{width}}  {seconds:9.3f} s  {share}".rstrip())
        return "\n".join(lines)

    def close(self) -> None:
        self.stream.flush()


class JsonlSink:
    """One JSON object per logged step, ``{"step": N, **metrics}``, appended to ``<output_dir>/metrics.jsonl``."""

    def __init__(self, output_dir: str) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        pass


def truncate_metrics(output_dir: str, start_step: int) -> list[dict[str, Any]]:
    """Keep only the records of steps before ``start_step`` in ``<output_dir>/metrics.jsonl`` (a resumed run logs the
    steps after its checkpoint again; 0 empties it). Rewritten through a temporary file, so a crash keeps the old
    one. Returns every whole record the file held, the removed ones too (``restart_metrics`` counts the steps done
    again from them)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    kept, records = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
            if record["step"] < start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):  # a line torn by a crash mid-write
            continue
        records.append(record)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text("".join(kept), encoding="utf-8")
    staging.replace(path)
    return records


def restart_metrics(records: list[dict[str, Any]], start_step: int) -> dict[str, int]:
    """What faults cost the run so far, logged with every step: ``faults/restarts``, the rounds torchrun restarted
    this job (``TORCHELASTIC_RESTART_COUNT``), and ``faults/steps_redone``, the logged steps at or after
    ``start_step`` in ``records`` (the metrics file before a resume cut it back: steps done again) added to the
    count the earlier records carry, so it sums over every resume of the run directory."""
    redone_before = max((int(record.get("faults/steps_redone", 0)) for record in records), default=0)
    lost = [record["step"] for record in records if record["step"] >= start_step]
    return {
        "faults/restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "faults/steps_redone": redone_before + (max(lost) + 1 - start_step if lost else 0),
    }


def _missing_package(logger: str, package: str, error: ImportError) -> ImportError:
    return ImportError(
        f"trainer.loggers has {logger}, which needs the {package} package ({error}); install it with "
        f"`pip install {package}` (or `pip install 'spmd_rlhf[logging]'`), or remove {logger} from trainer.loggers"
    )


class TensorBoardSink:
    """Every metric as a TensorBoard scalar at ``step``, in ``<output_dir>/tensorboard``; flushed after each step."""

    def __init__(self, output_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise _missing_package("tensorboard", "tensorboard", error) from error
        self.log_dir = Path(output_dir) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run named ``run_name`` in ``project``, holding ``run_config`` as its config and every metric at
    ``step``. wandb's own environment variables apply (``WANDB_MODE=offline``, ``WANDB_ENTITY``, ...)."""

    def __init__(
        self, output_dir: str, *, project: str, run_name: str, run_config: dict[str, Any] | None = None
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise _missing_package("wandb", "wandb", error) from error
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, dir=output_dir, config=run_config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = ("console", "jsonl", "tensorboard", "wandb")
"""The names ``trainer.loggers`` accepts (a test keeps them equal to ``TrainerConfig``'s check)."""


def build_sinks(
    trainer: TrainerConfig, *, run_config: dict[str, Any] | None = None, stream: TextIO | None = None
) -> list[Sink]:
    """``metrics.jsonl`` and the other sinks ``trainer.loggers`` names, in ``SINKS`` order; ``run_config`` (the resolved
    config as a dict) becomes the wandb run's config, ``stream`` replaces stdout for the console."""
    unknown = sorted(set(trainer.loggers) - set(SINKS))
    if unknown:
        raise ValueError(f"trainer.loggers: {unknown} are unknown; choose from {', '.join(SINKS)}")
    sinks: list[Sink] = []
    if "console" in trainer.loggers:
        sinks.append(ConsoleSink(total_steps=trainer.total_steps, timing_every=trainer.timing_every, stream=stream))
    sinks.append(JsonlSink(trainer.output_dir))  # always: it is the run's record, and what spmd-rlhf plot reads
    if "tensorboard" in trainer.loggers:
        sinks.append(TensorBoardSink(trainer.output_dir))
    if "wandb" in trainer.loggers:
        run_name = trainer.wandb_run_name or Path(trainer.output_dir).resolve().name
        sinks.append(
            WandbSink(trainer.output_dir, project=trainer.wandb_project, run_name=run_name, run_config=run_config)
        )
    return sinks
