"""``spmd-rlhf plot``: PNG charts of a run's ``metrics.jsonl``, one per chart, plus an ``index.html`` showing them all.

    spmd-rlhf plot outputs/grpo                                # outputs/grpo/plots/{reward,kl,...}.png
    spmd-rlhf plot outputs/grpo --out plots --keys reward/mean 'critic/*'

The default charts are reward (and ``val/reward/mean``), KL, entropy, response length and stage times
(``time/<stage>``); a chart whose metrics the run does not have is left out. ``--keys`` draws one chart per key or
shell-style pattern instead. Rendered with matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import fnmatch
import html
import importlib.util
import json
import re
from pathlib import Path

DEFAULT_CHARTS = (
    ("reward", ("reward/mean", "val/reward/mean"), "mean score"),
    ("kl", ("kl/mean",), "KL(actor || reference)"),
    ("entropy", ("actor/entropy",), "nats per token"),
    ("response_length", ("response_length/mean", "val/response_length/mean"), "tokens"),
    ("stage_times", ("time/*",), "seconds"),
)
"""(chart name, metric keys or shell-style patterns drawn on it, y-axis label) of ``spmd-rlhf plot`` without
``--keys``."""


class PlotError(ValueError):
    """The run's metrics cannot be plotted: a missing or empty ``metrics.jsonl``, a bad line, an unknown key."""


def metrics_file(run_dir: str) -> Path:
    """``run_dir/metrics.jsonl``, or ``run_dir`` itself when it is a file."""
    path = Path(run_dir)
    return path / "metrics.jsonl" if path.is_dir() else path


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl``."""
    if not path.is_file():
        raise PlotError(
            f"{path} not found; pass the run's trainer.output_dir "
            "(it holds metrics.jsonl when trainer.loggers has jsonl)"
        )
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PlotError(f"{path}:{number} is not a JSON object: {error}") from error
        if not isinstance(record, dict) or "step" not in record:
            raise PlotError(f"{path}:{number} is not a metrics record (a JSON object with a step)")
        records.append(record)
    if not records:
        raise PlotError(f"{path} is empty: the run has not logged a step yet")
    return records


def matching_keys(records: list[dict[str, float]], patterns: tuple[str, ...]) -> list[str]:
    """The numeric metric keys of ``records`` matching any of ``patterns``, in pattern order, then sorted."""
    available = sorted(
        {key for record in records for key, value in record.items() if key != "step" and _is_number(value)}
    )
    keys: list[str] = []
    for pattern in patterns:
        keys += [key for key in fnmatch.filter(available, pattern) if key not in keys]
    return keys


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _chart_file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "chart"


def draw_chart(records: list[dict[str, float]], keys: list[str], *, title: str, ylabel: str, path: Path) -> None:
    """One PNG: each key as a line over ``step`` (with markers when it was logged at only a few steps; the whole
    step's time dashed, as the total the stages add up to)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for key in keys:
        points = [(record["step"], record[key]) for record in records if _is_number(record.get(key))]
        steps, values = zip(*points)
        style = {"color": "black", "linestyle": "--"} if key == "time/step" else {}
        axes.plot(steps, values, label=key, marker="o" if len(points) <= 20 else None, markersize=3, **style)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")


def plot_run(run_dir: str, *, out_dir: str | None = None, keys: list[str] | None = None) -> list[Path]:
    """Write one PNG per chart of ``run_dir``'s metrics to ``out_dir`` (default ``run_dir/plots``) and an
    ``index.html`` showing them; returns the written paths, index last. ``keys``: one chart per key or pattern
    instead of ``DEFAULT_CHARTS``, each of which must match a metric."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotError("spmd-rlhf plot needs matplotlib: pip install matplotlib (or pip install 'spmd_rlhf[logging]')")
    path = metrics_file(run_dir)
    records = read_metrics(path)
    charts = [(key, (key,), "") for key in keys] if keys else list(DEFAULT_CHARTS)
    out = Path(out_dir) if out_dir else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, patterns, ylabel in charts:
        chart_keys = matching_keys(records, patterns)
        if not chart_keys:
            if keys:
                known = ", ".join(matching_keys(records, ("*",)))
                raise PlotError(f"--keys {name}: no metric matches it; the run has: {known}")
            continue
        png = out / f"{_chart_file_name(name)}.png"
        draw_chart(records, chart_keys, title=name, ylabel=ylabel, path=png)
        written.append(png)
    if not written:
        raise PlotError(f"{path} has none of the default charts' metrics; choose some with --keys")
    index = out / "index.html"
    images = "\n".join(f'<h2>{html.escape(png.stem)}</h2>\n<img src="{html.escape(png.name)}">' for png in written)
    index.write_text(f"<!doctype html>\n<title>{html.escape(str(path))}</title>\n{images}\n", encoding="utf-8")
    return [*written, index]
