"""The child program of ``rewards.code``: limits itself, runs one test of one program, reports one JSON line.

Run as ``python -I -S _code_child.py`` in a fresh temporary directory holding ``request.json``:
``{"mode": "stdio" | "call" | "assert", "program": str, "memory_bytes": int, "cpu_seconds": int, "file_bytes": int,
"fn_name": str, "args": list, "test": str, "entry_point": str | None, "nonce": str}``. It imports nothing from the
package, deletes the request, and sets its limits before it compiles the program. The program's stdout is the
parent's stdout pipe (its answer in ``stdio`` mode); the report goes to the original stderr, which the program no
longer sees as fd 2: ``{"status": "ok" | "wrong_answer" | "runtime_error" | "syntax_error" | "memory", ...}``, with
``"result"`` (the call's return value as JSON) in ``call`` mode and the parent's ``"nonce"`` once an ``assert`` test
has run to its end, so that a program which exits early (``os._exit(0)``) does not pass. The parent never sends the
expected outputs: it compares them itself.

Limits: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_NPROC`` = 0 (no new processes), ``RLIMIT_FSIZE`` (file
size), no core files. ``RLIMIT_NPROC`` does not bind root, and limits cannot confine where a program writes, so an
audit hook also refuses, while the program runs: new processes, ``ctypes``, sockets, signals to other processes,
raising limits, writing or deleting outside the directory, and reading other processes' ``/proc`` entries (their
environments). Audit hooks are not a security boundary against code written to escape them (the parent runs the
child with no environment, kills its whole session after each test, and reads at most a fixed number of bytes);
run untrusted policies in a container as well.
"""

import json
import os
import resource
import sys

_REFUSED_EVENTS = frozenset(
    (
        "os.fork",
        "os.forkpty",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "os.startfile",
        "os.kill",
        "os.killpg",
        "subprocess.Popen",
        "pty.spawn",
        "socket.__new__",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.cdata",
        "resource.setrlimit",
        "resource.prlimit",
    )
)
_PATH_EVENTS = frozenset(
    (
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.rename",
        "os.link",
        "os.symlink",
        "os.truncate",
        "os.chmod",
        "os.chown",
        "os.utime",
        "shutil.rmtree",
    )
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _inside(path, root):
    if not isinstance(path, (str, bytes)):  # a directory descriptor, a mode, times: not a path
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep)


def _audit_hook(root):
    own_proc = f"/proc/{os.getpid()}"

    def hook(event, arguments):
        if event in _REFUSED_EVENTS or (event == "import" and arguments[0] in ("ctypes", "_ctypes")):
            raise PermissionError(f"{event} is not allowed in the sandbox")
        if event in _PATH_EVENTS and not all(_inside(path, root) for path in arguments[:2] if path is not None):
            raise PermissionError(f"{event} outside the working directory is not allowed")
        if event == "open" and not isinstance(arguments[0], int):
            path = os.path.realpath(os.fsdecode(arguments[0]))
            if arguments[2] & _WRITE_FLAGS and not _inside(path, root):
                raise PermissionError(f"writing {path} is not allowed")
            if path.startswith("/proc/") and not (path == own_proc or path.startswith(own_proc + "/")):
                raise PermissionError(f"reading {path} is not allowed")

    return hook


def _limit(request):
    for limit, value in (
        (resource.RLIMIT_AS, request["memory_bytes"]),
        (resource.RLIMIT_CPU, request["cpu_seconds"]),
        (resource.RLIMIT_NPROC, 0),
        (resource.RLIMIT_FSIZE, request["file_bytes"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))


def _run(request, namespace):
    """What the test gave, as the report's entries; the program's exceptions propagate."""
    mode = request["mode"]
    code = compile(request["program"], "<program>", "exec", dont_inherit=True)
    if mode == "stdio":
        try:
            exec(code, namespace)
        except SystemExit as ended:
            if ended.code not in (None, 0):
                raise
        return {"status": "ok"}
    exec(code, namespace)
    if mode == "call":
        function = namespace.get(request["fn_name"])
        if function is None and isinstance(namespace.get("Solution"), type):  # LeetCode style
            function = getattr(namespace["Solution"](), request["fn_name"], None)
        if not callable(function):
            return {"status": "runtime_error", "error": f"the program defines no function {request['fn_name']!r}"}
        result = function(*request["args"])
        try:
            return {"status": "ok", "result": json.loads(json.dumps(result))}
        except (TypeError, ValueError):
            return {"status": "wrong_answer", "error": f"returned a {type(result).__name__}, not JSON data"}
    exec(compile(request["test"], "<test>", "exec", dont_inherit=True), namespace)
    entry_point = request.get("entry_point")
    if entry_point and callable(namespace.get("check")):  # HumanEval: the test defines check(candidate)
        namespace["check"](namespace[entry_point])
    return {"status": "ok", "nonce": request["nonce"]}


def main():
    with open("request.json") as file:
        request = json.load(file)
    os.remove("request.json")
    report = os.fdopen(os.dup(2), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    sys.stderr = open(devnull, "w", closefd=False)
    _limit(request)
    namespace = {"__name__": "__main__" if request["mode"] == "stdio" else "__solution__", "__builtins__": __builtins__}
    sys.addaudithook(_audit_hook(os.getcwd()))
    try:
        answer = _run(request, namespace)
    except SyntaxError as error:
        answer = {"status": "syntax_error", "error": f"{type(error).__name__}: {error}"}
    except MemoryError:
        answer = {"status": "memory", "error": "MemoryError"}
    except AssertionError as error:
        answer = {"status": "wrong_answer", "error": f"AssertionError: {error}"}
    except BaseException as error:  # the program's own failure, reported
        answer = {"status": "runtime_error", "error": f"{type(error).__name__}: {str(error)[:300]}"}
    try:
        sys.stdout.flush()
    except BaseException:  # the parent stopped reading: past the output cap
        pass
    report.write(json.dumps(answer) + "\n")
    report.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
