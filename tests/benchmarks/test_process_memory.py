"""``benchmarks/process_memory.py``: the peak resident set size of each process a command starts, seen from outside."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from process_memory import run_with_peak_rss  # noqa: E402

MIB = 2**20


def test_peak_of_a_child_that_allocated_and_freed(tmp_path):
    """A child of the command holds 200 MiB for a moment, then frees it: its peak still shows them, the parent's not."""
    child = "import time; block = bytearray(200 * 2**20); time.sleep(0.5); del block; time.sleep(0.3)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    with open(tmp_path / "log", "w") as out:
        returncode, peaks = run_with_peak_rss([sys.executable, "-c", parent], cwd=str(tmp_path), env={}, stdout=out)
    assert returncode == 0
    assert len(peaks) == 2
    assert peaks[1] >= 200 * MIB > peaks[0]


def test_exit_code_comes_back(tmp_path):
    with open(tmp_path / "log", "w") as out:
        returncode, _ = run_with_peak_rss(
            [sys.executable, "-c", "raise SystemExit(3)"], cwd=str(tmp_path), env={}, stdout=out
        )
    assert returncode == 3
