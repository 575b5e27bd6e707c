"""Recipe classes are importable and usable from a custom loop: ``recipes/examples/custom_loop.py`` subclasses
GRPORecipe, changes its advantage stage, and drives it step by step under torchrun."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from torchrun_helpers import torchrun

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_custom_loop_runs_the_changed_stage(tmp_path):
    shutil.copytree(RECIPES / "configs", tmp_path / "recipes" / "configs")
    finished = torchrun(
        str(RECIPES / "examples" / "custom_loop.py"), "3", nproc=2, timeout=240, cwd=str(tmp_path), forked=True
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    lines = re.findall(r"step (\d): reward ([\d.]+) clipped ([\d.]+)", finished.stdout)
    assert [int(step) for step, _, _ in lines] == [0, 1, 2]
    assert all(0.0 <= float(clipped) <= 1.0 for _, _, clipped in lines)
