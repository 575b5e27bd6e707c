"""Built-in tools that run in a separate process under a time and memory limit: a calculator and a Python
interpreter.

Each call starts a bare interpreter (``python -I -S``, no site packages, nothing of this package) on
``_sandbox_child.py`` in a fresh temporary directory. The child sets ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` and
``RLIMIT_NPROC`` = 0 (no forking) on itself before it looks at the arguments, and an audit hook that refuses starting
processes, ``ctypes`` and raising limits (``RLIMIT_NPROC`` does not bind root); the parent kills it past the
wall-clock timeout. A crash, a kill by a limit, a hang or unreadable output is an error observation, never an exception
in the rollout. This limits resources; it is not isolation: the Python tool can read what the user running the job can
read. Run untrusted policies' code in a container as well.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from spmd_rlhf.envs.tools import Tool

_CHILD = Path(__file__).with_name("_sandbox_child.py")


class SandboxError(RuntimeError):
    """The sandboxed tool failed: its own error, a limit, a crash or unreadable output."""


def run_sandboxed(
    tool: str, arguments: dict[str, Any], *, timeout_s: float, memory_bytes: int, cpu_seconds: int
) -> str:
    """The output text of built-in ``tool`` ("calculator" or "python") on ``arguments``, run in a child process;
    raises ``SandboxError`` saying what went wrong."""
    request = json.dumps(
        {"tool": tool, "arguments": arguments, "memory_bytes": memory_bytes, "cpu_seconds": cpu_seconds}
    )
    with tempfile.TemporaryDirectory(prefix="spmd_rlhf_tool_") as workdir:
        try:
            finished = subprocess.run(
                [sys.executable, "-I", "-S", str(_CHILD)],
                input=request + "\n",
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=workdir,
                env={},
            )
        except subprocess.TimeoutExpired:
            raise SandboxError(f"timed out after {timeout_s:g} s") from None
    lines = finished.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        why = f"exited with code {finished.returncode}" if finished.returncode else "gave unreadable output"
        if finished.returncode < 0:
            why = f"was killed by signal {-finished.returncode} (a CPU or memory limit)"
        raise SandboxError(f"{why}: {finished.stderr.strip()[-300:]}")
    if not answer["ok"]:
        raise SandboxError(str(answer.get("error")))
    return str(answer["output"])


def sandboxed_tool(
    name: str, *, timeout_s: float = 10.0, memory_bytes: int = 256 * 1024**2, cpu_seconds: int = 5
) -> Tool:
    """The built-in ``calculator`` or ``python`` tool, each call in its own limited child process."""
    if name not in BUILTIN_SCHEMAS:
        raise ValueError(f"unknown built-in tool {name!r}; built-in tools: {', '.join(BUILTIN_SCHEMAS)}")
    description, parameters = BUILTIN_SCHEMAS[name]

    def call(**arguments: Any) -> str:
        return run_sandboxed(name, arguments, timeout_s=timeout_s, memory_bytes=memory_bytes, cpu_seconds=cpu_seconds)

    # The thread that waits on the child gets a little longer than the child's own timeout, which ends the call.
    return Tool(name, description, parameters, call, timeout_s=timeout_s + 5.0)


BUILTIN_SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "calculator": (
        "Evaluate an arithmetic expression of numbers and + - * / // % ** with parentheses; returns its value.",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123*456"}},
            "required": ["expression"],
        },
    ),
    "python": (
        "Run a Python program and return what it prints (no network; limited time and memory).",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    ),
}
"""The built-in tools' descriptions and argument schemas (the child program implements them)."""
