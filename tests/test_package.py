"""The installed package: recipes/ and kernels/ mapped into the namespace, the console script with its subcommands."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("module,folder", [("spmd_rlhf.recipes", "recipes"), ("spmd_rlhf.kernels", "kernels")])
def test_top_level_folders_import_under_the_package(module, folder):
    imported = importlib.import_module(module)
    assert os.path.samefile(os.path.dirname(imported.__file__), os.path.join(REPO, folder))


def test_console_script_lists_subcommands():
    script = shutil.which("spmd-rlhf")
    assert script is not None, "spmd-rlhf is not on PATH: install the package (pip install -e .)"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    for command in ("make-tiny", "make-task", "config", "forward", "export", "plot"):
        assert command in result.stdout
