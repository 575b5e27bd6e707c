"""``benchmarks/tp_decode_host.py`` end to end at two layers: every path timed at every row count, written out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tp_decode_host_benchmark_times_every_path(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "tp_decode_host.py"), "--layers", "2", "--rows", "1", "2"]
    finished = subprocess.run(
        [*command, "--repeats", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    result = json.loads((tmp_path / "tp_decode_host_cpu.json").read_text())
    assert [row["rows"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert all(row[key] > 0 for key in ("one_rank_s", "dtensor_s", "local_s"))
