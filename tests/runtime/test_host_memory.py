"""A CPU rank restarts itself once with glibc's huge-page tunable, and only when that can help and can reproduce it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from spmd_rlhf.runtime.host_memory import RESTART_MARK, huge_page_restart, thp_mode

SCRIPT_ARGS = dict(argv=["recipes/grpo.py", "a=1"], orig_argv=["python", "-u", "recipes/grpo.py", "a=1"])


def test_restart_adds_the_tunable_and_keeps_the_command_line():
    command, environment = huge_page_restart(
        environ={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, mode="madvise", libc="glibc", **SCRIPT_ARGS
    )
    assert command == ["python", "-u", "recipes/grpo.py", "a=1"]
    assert environment["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert environment[RESTART_MARK] == "1"


@pytest.mark.parametrize(
    "case",
    [
        dict(mode="always"),
        dict(mode="never"),
        dict(mode=None),
        dict(libc="musl"),
        dict(environ={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}),
        dict(environ={RESTART_MARK: "1"}),
        dict(argv=["ppo", "a=1"]),  # started inside another program (pytest) whose argv was replaced
        dict(argv=["recipes/grpo.py"], orig_argv=["python", "-m", "pytest"]),
    ],
)
def test_no_restart_where_it_gains_nothing_or_cannot_reproduce_the_process(case):
    arguments = dict(environ={}, mode="madvise", libc="glibc", **SCRIPT_ARGS) | case
    assert huge_page_restart(**arguments) is None


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    assert thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.skipif(
    thp_mode() != "madvise" or platform.libc_ver()[0] != "glibc", reason="needs glibc and THP in madvise mode"
)
def test_a_script_restarts_in_place_once(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import os\nprint('start', os.getpid(), flush=True)\n"
        "from spmd_rlhf.runtime.host_memory import restart_with_huge_pages\nrestart_with_huge_pages()\n"
        "print('tunables', os.environ.get('GLIBC_TUNABLES'), flush=True)\n"
    )
    environment = {key: value for key, value in os.environ.items() if key not in ("GLIBC_TUNABLES", RESTART_MARK)}
    lines = subprocess.run(
        [sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    starts = [line for line in lines if line.startswith("start")]
    assert len(starts) == 2 and starts[0] == starts[1]  # the same pid, started twice
    assert "tunables glibc.malloc.hugetlb=1" in lines
