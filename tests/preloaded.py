"""``python <recipe> ARGS`` as a fork of a process that has already imported the package: the script runs as
``__main__`` in a fresh process of its own (its own pid, directory, output and exit code), without the seconds of
imports (torch, transformers, DTensor) every interpreter start pays. For suites of short one-process jobs, such as the
bad-input cases that stop at start and the recipes' ``--help`` and ``--dry-run``.

    with PreloadedPython() as python:
        finished = python.run(["recipes/grpo.py", "--config", "..."], cwd=workdir, timeout=240)

The server is this file run as a program: it imports ``PRELOADED``, then reads one JSON request a line and answers
each with the forked job's exit code, one job at a time.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from torchrun_helpers import environment

PRELOADED = ("spmd_rlhf.config", "spmd_rlhf.controller", "spmd_rlhf.metrics.step_metrics", "transformers")
"""What the recipes import at their top and on their way to a first step."""


class PreloadedPython:
    """One server process; ``run`` is ``subprocess.run([sys.executable, *argv], stdout=PIPE, stderr=STDOUT, ...)``
    for a script, one job at a time."""

    def __init__(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environment(recipe=True),
        )

    def run(
        self, argv: list[str], *, cwd: Path, timeout: float, stderr_apart: bool = False
    ) -> subprocess.CompletedProcess:
        """stdout and stderr together in ``.stdout``, or (``stderr_apart``) each in its own field."""
        output, errors = cwd / ".preloaded_stdout", cwd / ".preloaded_stderr"
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "stdout": str(output),
            "stderr": str(errors if stderr_apart else output),
            "timeout": timeout,
        }
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        answer = json.loads(self.server.stdout.readline())
        stdout = output.read_text()
        output.unlink()
        stderr = None
        if stderr_apart:
            stderr = errors.read_text()
            errors.unlink()
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess([sys.executable, *argv], answer["returncode"], stdout, stderr)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)

    def __enter__(self) -> PreloadedPython:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _run_script(argv: list[str], cwd: str, stdout: str, stderr: str) -> int:
    """In the forked child: what ``python argv[0] argv[1:]`` does after its interpreter started. Returns the exit
    code."""
    os.chdir(cwd)
    descriptor = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    if stderr != stdout:
        os.close(descriptor)
        descriptor = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _serve() -> None:
    for module in PRELOADED:
        __import__(module)
    # A fork copies only the forking thread: any other would be missing in the child, holding whatever lock it held.
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "the server started threads"
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        child = os.fork()
        if child == 0:
            os._exit(_run_script(request["argv"], request["cwd"], request["stdout"], request["stderr"]))
        deadline, status, timed_out = time.monotonic() + request["timeout"], None, False
        while status is None:
            finished, status_word = os.waitpid(child, os.WNOHANG)
            if finished:
                status = status_word
            elif time.monotonic() > deadline:
                os.kill(child, signal.SIGKILL)
                status, timed_out = os.waitpid(child, 0)[1], True
            else:
                time.sleep(0.05)
        returncode = os.waitstatus_to_exitcode(status)
        print(json.dumps({"returncode": returncode, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    _serve()
