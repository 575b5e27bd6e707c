"""Tests for ``spmd-rlhf plot``: PNG charts and an index from a synthetic ``metrics.jsonl``, and clear errors for a
missing or empty file and for keys the run does not have."""

from __future__ import annotations

import json

import pytest

from spmd_rlhf.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_dir(tmp_path):
    records = []
    for step in range(12):
        record = {
            "step": step,
            "reward/mean": 0.1 * step,
            "kl/mean": 0.01 * step,
            "actor/entropy": 2.0 - 0.1 * step,
            "response_length/mean": 5.0 + step,
            "time/step": 1.0,
            "time/generate": 0.6,
            "time/update_actor": 0.3,
        }
        if step % 5 == 4:
            record.update({"val/reward/mean": 0.5, "time/validate": 0.2})
        records.append(record)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run


def test_plot_writes_the_default_charts_and_an_index(run_dir, capsys):
    assert main(["plot", str(run_dir)]) == 0
    names = ["reward", "kl", "entropy", "response_length", "stage_times"]
    for name in names:
        png = run_dir / "plots" / f"{name}.png"
        assert png.read_bytes().startswith(PNG_SIGNATURE) and png.stat().st_size > 5_000, name
    index = (run_dir / "plots" / "index.html").read_text()
    assert [line.split('"')[1] for line in index.splitlines() if line.startswith("<img")] == [
        f"{name}.png" for name in names
    ]
    assert capsys.readouterr().out.splitlines()[0] == f"wrote {run_dir / 'plots' / 'reward.png'}"


def test_plot_keys_and_patterns_make_one_chart_each(run_dir, tmp_path):
    out = tmp_path / "charts"
    assert main(["plot", str(run_dir / "metrics.jsonl"), "--out", str(out), "--keys", "kl/mean", "time/*"]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["index.html", "kl_mean.png", "time.png"]


def test_plot_skips_default_charts_the_run_lacks(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    stripped = [{key: value for key, value in json.loads(line).items() if not key.startswith("kl/")} for line in lines]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in stripped))
    assert main(["plot", str(run_dir)]) == 0
    assert not (run_dir / "plots" / "kl.png").exists() and (run_dir / "plots" / "reward.png").exists()


@pytest.mark.parametrize(
    "contents,message",
    [
        (None, "metrics.jsonl not found; pass the run's trainer.output_dir"),
        ("", "metrics.jsonl is empty: the run has not logged a step yet"),
        ('{"step": 0}\nnot json\n', "metrics.jsonl:2 is not a JSON object"),
    ],
)
def test_plot_fails_clearly_on_a_bad_metrics_file(tmp_path, capsys, contents, message):
    if contents is not None:
        (tmp_path / "metrics.jsonl").write_text(contents)
    assert main(["plot", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("plot error: ") and message in error
    assert not (tmp_path / "plots").exists()


def test_plot_names_an_unknown_key_and_what_the_run_has(run_dir, capsys):
    assert main(["plot", str(run_dir), "--keys", "critic/loss"]) == 2
    assert "--keys critic/loss: no metric matches it; the run has: actor/entropy, kl/mean" in capsys.readouterr().err
