"""Code RL's rule reward: run the response's program against the row's tests, each test in its own limited child
process, and score the share that pass.

The program is the response's last ```` ```python ```` block (``py``, ``python3`` too), else the whole response. The
tests are the row's ``ground_truth``, a dict or its JSON text, in one of the schemas code-RL sets use:

- stdin/stdout pairs (APPS, TACO, CodeContests): ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``, or a list
  of ``{"input": ..., "output": ...}``; an output matches when its whitespace-separated tokens do (numbers within
  1e-6);
- call-based (APPS, TACO, LeetCode): ``{"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}``; the
  function (or ``Solution().fn_name``) is called with each argument list and its result compared as JSON data (APPS's
  one-element list around the expected value is accepted too);
- assert-style (HumanEval, MBPP): ``{"test": "<code with asserts>", "entry_point": "name"}``, run after the program
  (with HumanEval's ``check(candidate)`` called on ``entry_point`` when the test defines it); a list of assert lines
  (MBPP's ``test_list``) is one test per line.

Each test starts a bare interpreter on ``_code_child.py`` (see its docstring for the limits it sets on itself and
what it refuses) in a fresh temporary directory, with no environment variables, in a session of its own that is
killed when the test ends; at most ``output_limit_bytes`` of output are read, and it is killed past
``time_limit_s`` plus ``STARTUP_S`` of wall-clock time. Every failure is a failed test, counted by kind.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CODE_DATA_SOURCES = ("code", "codecontests", "apps", "taco", "codeforces", "livecodebench")
"""The names ``code_score`` is registered under: verl's code data sources, plus the short name ``code``."""
OUTCOMES = ("passed", "wrong_answer", "runtime_error", "syntax_error", "timeout", "memory", "output_limit")
"""How a test can end; ``code_score`` returns the count of each."""
STARTUP_S = 1.0
"""Wall-clock seconds a test gets beyond ``time_limit_s``: the interpreter's start, more on a loaded machine."""
FILE_BYTES = 16 * 1024**2
"""``RLIMIT_FSIZE``: the largest file a program may write (in its own directory)."""
FLOAT_TOLERANCE = 1e-6
"""Absolute and relative tolerance of numeric output tokens."""

_CHILD = Path(__file__).with_name("_code_child.py")
_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class CodeTest:
    """One test: how the child runs it (``mode`` and its request entries), the program's stdin, and the expected
    output or return value, which only the parent sees."""

    mode: str
    request: dict[str, Any] = field(default_factory=dict)
    stdin: str = ""
    expected: Any = None


def extract_program(response: str) -> str:
    """The last ```` ```python ```` (or ``py``, ``python3``) fenced block of ``response``, else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(ground_truth: Any) -> list[CodeTest]:
    """The tests in ``ground_truth`` (a dict, a list of input/output pairs, or their JSON text); a ``ValueError``
    naming the schemas when it holds none."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if isinstance(tests, list) and all(isinstance(pair, dict) and {"input", "output"} <= pair.keys() for pair in tests):
        tests = {"inputs": [pair["input"] for pair in tests], "outputs": [pair["output"] for pair in tests]}
    if isinstance(tests, dict) and len(tests.get("test", ())):
        lines = _as_list(tests["test"])
        lines = lines if isinstance(lines, list) else [lines]
        return [CodeTest("assert", {"test": line, "entry_point": tests.get("entry_point")}) for line in lines]
    inputs = _as_list(tests.get("inputs")) if isinstance(tests, dict) else None
    outputs = _as_list(tests.get("outputs")) if isinstance(tests, dict) else None
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError(
            "ground_truth holds no tests: expected {'inputs': [...], 'outputs': [...]} of equal non-zero length "
            "(with 'fn_name' for call-based tests), a list of {'input', 'output'}, or {'test': ..., 'entry_point': ...}"
        )
    if tests.get("fn_name"):
        return [
            CodeTest("call", {"fn_name": tests["fn_name"], "args": _arguments(args)}, "", _as_list(out))
            for args, out in zip(inputs, outputs)
        ]
    return [CodeTest("stdio", {}, _text(given), _text(out)) for given, out in zip(inputs, outputs)]


def code_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    time_limit_s: float = 4.0,
    memory_mb: int = 512,
    output_limit_bytes: int = 1024**2,
    all_or_nothing: bool = False,
    max_tests: int | None = None,
) -> dict[str, float]:
    """The share of ``ground_truth``'s tests (the first ``max_tests``) the response's program passes, or with
    ``all_or_nothing`` 1 when it passes all (it then stops at the first failure); plus the count of each of
    ``OUTCOMES``. Each test runs under ``time_limit_s`` of CPU time (whole seconds, rounded up) and wall-clock time
    (plus ``STARTUP_S``), ``memory_mb`` of address space and ``output_limit_bytes`` of output."""
    if time_limit_s <= 0 or memory_mb <= 0 or output_limit_bytes <= 0 or (max_tests is not None and max_tests < 1):
        raise ValueError(
            f"code_score: time_limit_s={time_limit_s}, memory_mb={memory_mb}, output_limit_bytes={output_limit_bytes} "
            f"and max_tests={max_tests} must be > 0 (max_tests may be None: all tests)"
        )
    program = extract_program(solution_str)
    tests = parse_tests(ground_truth)[:max_tests]
    counts = dict.fromkeys(OUTCOMES, 0)
    try:
        compile(program, "<program>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError):  # ValueError: a null byte; RecursionError: deep nesting
        counts["syntax_error"] = len(tests)
        return {"score": 0.0, **counts}
    for test in tests:
        outcome = run_test(
            program, test, time_limit_s=time_limit_s, memory_mb=memory_mb, output_limit_bytes=output_limit_bytes
        )
        counts[outcome] += 1
        if all_or_nothing and outcome != "passed":
            break
    passed = counts["passed"]
    score = float(passed == len(tests)) if all_or_nothing else passed / len(tests)
    return {"score": score, **counts}


def run_test(program: str, test: CodeTest, *, time_limit_s: float, memory_mb: int, output_limit_bytes: int) -> str:
    """How ``program`` does on ``test`` (one of ``OUTCOMES``), run in a fresh limited child process."""
    nonce = secrets.token_hex(16)
    request = {
        "mode": test.mode,
        "program": program,
        "memory_bytes": memory_mb * 1024**2,
        "cpu_seconds": math.ceil(time_limit_s),
        "file_bytes": FILE_BYTES,
        "nonce": nonce,
        **test.request,
    }
    with tempfile.TemporaryDirectory(prefix="spmd_rlhf_code_") as workdir, tempfile.TemporaryFile() as stdin:
        Path(workdir, "request.json").write_text(json.dumps(request))
        stdin.write(test.stdin.encode())
        stdin.seek(0)
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_CHILD)],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={},
            start_new_session=True,
        )
        try:
            stdout, report, stopped = _read_bounded(process, time_limit_s + STARTUP_S, output_limit_bytes)
        finally:
            _kill_session(process)
    if stopped:
        return stopped
    if process.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    lines = report.decode(errors="replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    status = answer.get("status") if isinstance(answer, dict) else None
    if status != "ok":
        return status if status in OUTCOMES else "runtime_error"  # no report: a crash, or the program exited early
    if test.mode == "stdio":
        return "passed" if outputs_match(stdout.decode(errors="replace"), test.expected) else "wrong_answer"
    if test.mode == "call":
        return "passed" if results_match(answer.get("result"), test.expected) else "wrong_answer"
    return "passed" if answer.get("nonce") == nonce else "runtime_error"


def outputs_match(output: str, expected: str) -> bool:
    """Whether ``output``'s whitespace-separated tokens are ``expected``'s, numbers within ``FLOAT_TOLERANCE``."""
    got, wanted = output.split(), expected.split()
    return len(got) == len(wanted) and all(_tokens_match(a, b) for a, b in zip(got, wanted))


def results_match(result: Any, expected: Any) -> bool:
    """Whether a call's ``result`` (JSON data) is ``expected``, or the one element of ``expected`` (APPS's form)."""
    if result == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and result == expected[0]


def _tokens_match(got: str, wanted: str) -> bool:
    if got == wanted:
        return True
    try:
        return math.isclose(float(got), float(wanted), rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    except ValueError:
        return False


def _as_list(value: Any) -> Any:
    """A numpy array (a list column read from Parquet) as a list; anything else as it is."""
    return value.tolist() if hasattr(value, "tolist") else value


def _arguments(value: Any) -> list:
    """A call-based test's argument list; a value that is not a list is the one argument."""
    value = _as_list(value)
    return value if isinstance(value, list) else [value]


def _text(value: Any) -> str:
    """A test's input or output as text: APPS sometimes stores a list of lines."""
    value = _as_list(value)
    return "\n".join(map(str, value)) + "\n" if isinstance(value, list) else str(value)


def _read_bounded(process: subprocess.Popen, timeout_s: float, limit_bytes: int) -> tuple[bytes, bytes, str | None]:
    """The child's stdout and report (stderr) until it exits; ``"timeout"`` or ``"output_limit"`` as the third item
    when it ran past ``timeout_s`` or wrote more than ``limit_bytes`` to either (reading then stops)."""
    received = {process.stdout: bytearray(), process.stderr: bytearray()}
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        for stream in received:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(received[process.stdout]), b"", "timeout"
            for key, _ in selector.select(left):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                received[key.fileobj] += data
                if len(received[key.fileobj]) > limit_bytes:
                    return bytes(received[process.stdout]), b"", "output_limit"
    # Waited for without reaping: until ``_kill_session`` has killed its process group, its id stays taken.
    while os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() >= deadline:  # closed its pipes, still running
            return bytes(received[process.stdout]), b"", "timeout"
        time.sleep(0.002)
    return bytes(received[process.stdout]), bytes(received[process.stderr]), None


def _kill_session(process: subprocess.Popen) -> None:
    """Kill the child and anything it started (its session's process group), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.stdout.close()
    process.stderr.close()
    process.wait()
