"""The child program of ``sandbox.run_sandboxed``: limits itself, runs one built-in tool, prints one JSON line.

Run as ``python -I -S _sandbox_child.py`` with the request as JSON on stdin:
``{"tool": "calculator" | "python", "arguments": {...}, "memory_bytes": int, "cpu_seconds": int}``. It imports
nothing from the package (a tool call costs one bare interpreter start), and sets its own resource limits before it
reads the tool's arguments, so no argument is ever evaluated without them. The answer on stdout is
``{"ok": true, "output": str}`` or ``{"ok": false, "error": str}``; anything else (a crash, a kill by a limit, a
hang the parent times out) the parent turns into an error observation.
"""

import ast
import contextlib
import io
import json
import operator
import resource
import sys

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_EXPRESSION_CHARS = 1000


def _evaluate(node):
    """Numbers and + - * / // % ** with parentheses only: no names, calls or attributes."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}; use numbers and + - * / // % **")


def calculator(expression):
    if not isinstance(expression, str) or len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {_MAX_EXPRESSION_CHARS} characters")
    value = _evaluate(ast.parse(expression.replace("^", "**"), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def python(code):
    if not isinstance(code, str):
        raise ValueError("code must be a string")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})
    return printed.getvalue()


TOOLS = {"calculator": calculator, "python": python}

REFUSED_EVENTS = frozenset(
    (
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "os.kill",
        "os.killpg",
        "subprocess.Popen",
        "pty.spawn",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "resource.setrlimit",
        "resource.prlimit",
    )
)
"""Audit events the tool's code may not raise: RLIMIT_NPROC = 0 does not stop root from forking, and a process
started here would outlive the parent's kill of this one."""


def refuse(event, arguments):
    if event in REFUSED_EVENTS or (event == "import" and arguments[0] in ("ctypes", "_ctypes")):
        raise PermissionError(f"{event} is not allowed in the sandbox")


def main():
    request = json.loads(sys.stdin.readline())
    resource.setrlimit(resource.RLIMIT_AS, (request["memory_bytes"], request["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (request["cpu_seconds"], request["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    sys.addaudithook(refuse)
    try:
        arguments = request["arguments"]
        if not isinstance(arguments, dict):
            raise ValueError("arguments must be a JSON object")
        output = TOOLS[request["tool"]](**arguments)
        answer = {"ok": True, "output": output}
    except BaseException as error:  # the tool's own failure, reported; the parent decides what it means
        answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    sys.stdout = sys.__stdout__
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
