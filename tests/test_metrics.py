"""Tests for step metrics: JSONL records, the console progress line, per-rank averaging, stage timers."""

from __future__ import annotations

import io
import json

import pytest

from spmd_rlhf.metrics import MetricsLogger, StageTimer, mean_over_ranks


def test_jsonl_gets_one_object_per_step_and_console_a_progress_line(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(str(tmp_path / "run"), loggers=["console", "jsonl"], total_steps=4, stream=stream)
    logger.log(0, {"reward/mean": 0.25, "response_length/mean": 3.0})
    logger.log(1, {"reward/mean": 0.5, "kl/mean": 0.01})
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 0, "reward/mean": 0.25, "response_length/mean": 3.0}, {"step": 1, "reward/mean": 0.5, "kl/mean": 0.01}]
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("step 2/4 [##########----------]  50% | reward 0.5 | kl 0.01 |") and "ETA 0:00:0" in lines[1]


def test_unavailable_loggers_are_named(tmp_path):
    with pytest.raises(ValueError, match="wandb"):
        MetricsLogger(str(tmp_path), loggers=["jsonl", "wandb"], total_steps=1)


def test_mean_over_ranks_and_timer():
    assert mean_over_ranks([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}
    timer = StageTimer()
    with timer("generate"):
        pass
    with timer("generate"):
        pass
    assert list(timer.metrics()) == ["time/generate"] and timer.metrics()["time/generate"] >= 0
