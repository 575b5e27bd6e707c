"""``python <recipe> ARGS`` as a fork of a process that has already imported the package: the script runs as
``__main__`` in a fresh process of its own (its own pid, directory, output and exit code), without the seconds of
imports (torch, transformers, DTensor) every interpreter start pays. For suites of short one-process jobs, such as the
bad-input cases that stop at start and the recipes' ``--help`` and ``--dry-run``; and, with ``nproc`` > 1, for a
recipe's ranks as torchrun would start them on one node (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``), without the agent: the tests of the recipes' and programs'
results (``torchrun_helpers.run_recipe``, ``torchrun(forked=True)``). Rank 0 then hosts the job's store, as it does
in a launch without torchrun, and keeps it until the other ranks have left (``runtime.rendezvous.depart``; a
program's ranks leave together after a barrier). Tests of how a job ends under faults use torchrun.

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
import socket
import subprocess
import sys
import tempfile
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
        self,
        argv: list[str],
        *,
        cwd: Path,
        timeout: float,
        stderr_apart: bool = False,
        nproc: int = 0,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """stdout and stderr together in ``.stdout``, or (``stderr_apart``) each in its own field. ``nproc``: that
        many ranks of one job (their output interleaved by lines), else one process without rank variables. ``env``:
        the job's environment (as a subprocess's), else the server's."""
        with tempfile.TemporaryDirectory(prefix="preloaded_") as outputs:
            return self._run(argv, cwd, timeout, stderr_apart, nproc, env, Path(outputs))

    def _run(
        self,
        argv: list[str],
        cwd: Path,
        timeout: float,
        stderr_apart: bool,
        nproc: int,
        env: dict[str, str] | None,
        outputs: Path,
    ) -> subprocess.CompletedProcess:
        output, errors = outputs / "stdout", outputs / "stderr"
        request = {
            "argv": argv,
            "cwd": str(cwd),
            "stdout": str(output),
            "stderr": str(errors if stderr_apart else output),
            "timeout": timeout,
            "nproc": nproc,
            "env": env,
        }
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        answer = json.loads(self.server.stdout.readline())
        stdout = output.read_text()
        stderr = errors.read_text() if stderr_apart else None
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


def _run_script(argv: list[str], cwd: str, stdout: str, stderr: str, *, append: bool = False) -> int:
    """In the forked child: what ``python argv[0] argv[1:]`` does after its interpreter started. Returns the exit
    code. ``append``: write after what the files hold (ranks of one job share them)."""
    os.chdir(cwd)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    descriptor = os.open(stdout, flags, 0o644)
    os.dup2(descriptor, 1)
    if stderr != stdout:
        os.close(descriptor)
        descriptor = os.open(stderr, flags, 0o644)
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
        nproc = request["nproc"]
        if nproc:
            for path in {request["stdout"], request["stderr"]}:
                open(path, "w").close()  # the ranks append to them
            port = _free_port()
        children = []
        for rank in range(max(nproc, 1)):
            child = os.fork()
            if child == 0:
                if request["env"] is not None:
                    os.environ.clear()
                    os.environ.update(request["env"])
                if nproc:
                    os.environ.update(
                        RANK=str(rank),
                        LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(nproc),
                        LOCAL_WORLD_SIZE=str(nproc),
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port),
                    )
                code = _run_script(
                    request["argv"], request["cwd"], request["stdout"], request["stderr"], append=bool(nproc)
                )
                os._exit(code)
            children.append(child)
        returncode, timed_out = _wait_for(children, deadline=time.monotonic() + request["timeout"])
        print(json.dumps({"returncode": returncode, "timed_out": timed_out}), flush=True)


FAILED_JOB_GRACE_S = 60.0
"""After a rank of a job fails, how long the others get to end on their own (the runtime's own failure handling ends
them within its timeouts) before they are killed, as torchrun's agent would stop them."""


def _wait_for(children: list[int], *, deadline: float) -> tuple[int, bool]:
    """Wait for every child; returns (the first non-zero exit code, else 0; whether the deadline killed them)."""
    codes: dict[int, int] = {}
    timed_out = False
    while len(codes) < len(children):
        for child in children:
            if child not in codes:
                finished, status_word = os.waitpid(child, os.WNOHANG)
                if finished:
                    codes[child] = os.waitstatus_to_exitcode(status_word)
                    if codes[child] != 0:
                        deadline = min(deadline, time.monotonic() + FAILED_JOB_GRACE_S)
        if len(codes) < len(children) and time.monotonic() > deadline:
            timed_out = not any(codes.values())
            for child in children:
                if child not in codes:
                    os.kill(child, signal.SIGKILL)
                    codes[child] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        time.sleep(0.05)
    failed = [code for code in (codes[child] for child in children) if code != 0]
    return (failed[0] if failed else 0), timed_out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    _serve()
