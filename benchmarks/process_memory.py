"""The peak memory of every process a command starts, measured from outside it: each process's ``VmHWM`` (the
kernel's high-water mark of its resident set size, allocator caches included), polled while the command runs.
Linux only (``/proc``). Not an entry point."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import IO


def _read_proc(pid: int, name: str) -> str:
    """``/proc/<pid>/<name>``; '' once the process has exited."""
    try:
        return (Path("/proc") / str(pid) / name).read_text()
    except OSError:
        return ""


def _peak_rss(pid: int) -> int | None:
    """The peak resident set size of process ``pid`` in bytes (``VmHWM``), None once it has exited."""
    line = next((line for line in _read_proc(pid, "status").splitlines() if line.startswith("VmHWM:")), None)
    return None if line is None else int(line.split()[1]) * 1024


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` now (from each process's parent id in ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _read_proc(int(entry.name), "stat")
            if stat:  # "pid (name) state ppid ...": the name may hold spaces, so split after its ")"
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, pending = [], [root]
    while pending:
        below = children.get(pending.pop(), [])
        found += below
        pending += below
    return found


def run_with_peak_rss(
    command: list[str], *, cwd: str, env: dict[str, str], stdout: IO, poll_s: float = 0.1
) -> tuple[int, list[int]]:
    """Run ``command`` (its output to ``stdout``) and poll every ``poll_s`` seconds the peak resident set size of it
    and every process below it; its exit code and each process's peak in bytes, in the order they were first seen,
    torchrun's agent (which only waits) left out. Exact but for growth in a process's last ``poll_s``."""
    peaks: dict[int, int] = {}
    agents: set[int] = set()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    while process.poll() is None:
        for pid in [process.pid, *_descendants(process.pid)]:
            peak = _peak_rss(pid)
            if peak is not None:
                peaks[pid] = max(peaks.get(pid, 0), peak)
                if "torch.distributed.run" in _read_proc(pid, "cmdline"):
                    agents.add(pid)
        time.sleep(poll_s)
    return process.returncode, [peak for pid, peak in peaks.items() if pid not in agents]
