"""Start test programs under real torchrun agents (one or several "nodes" on this machine) and collect their output."""

from __future__ import annotations

import functools
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from spmd_rlhf.runtime.host_memory import huge_page_restart, thp_mode

TESTS = Path(__file__).parent
RECIPES = TESTS.parent / "recipes"


def program_path(name: str) -> Path:
    """A test program by file name, from any ``tests/*/programs/`` directory (names are unique), or a path."""
    if Path(name).is_file():
        return Path(name)
    found = sorted(TESTS.glob(f"*/programs/{name}"))
    if len(found) != 1:
        raise FileNotFoundError(f"expected exactly one tests/*/programs/{name}, found {found}")
    return found[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def forked_ranks(function, nprocs: int, *args) -> dict:
    """``function(rank, port, results, *args)`` on ``nprocs`` forks of this process, which has imported what they run
    (a spawn would import it all again per rank); ``port`` is free for their process group, ``results`` a shared
    dict, returned as a plain one once every rank has ended."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.start_processes(function, args=(free_port(), results, *args), nprocs=nprocs, start_method="fork")
    return dict(results)


TIMING_PREFIXES = ("time/", "throughput/", "coordinator/", "faults/")
"""Metric prefixes a resumed run need not reproduce to equal an uninterrupted one: timings, and the run directory's
own history (``faults/steps_redone`` counts the steps a resume does again)."""


def torchrun_command(
    program: str, *args: str, nproc: int, nnodes: int = 1, port: int, monitor_interval_s: float | None = None
) -> list[str]:
    """``monitor_interval_s``: how often the agent polls its ranks (torchrun's default 0.1 s). A test of how the job
    itself reports a dead rank sets a few seconds, so on a loaded machine the agent does not SIGTERM the survivors
    before their own report is out."""
    monitor = [] if monitor_interval_s is None else [f"--monitor-interval={monitor_interval_s}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--max-restarts=0",
        *monitor,
        str(program_path(program)),
        *args,
    ]


def environment(*, recipe: bool = False) -> dict[str, str]:
    """The environment of the processes a test starts: one OpenMP thread each. ``recipe``: a recipe's ranks, started
    as their huge-page restart would start them again (``runtime/host_memory.py``: glibc's tunable set), so that none
    imports everything twice (about 2.5 s per rank); other programs keep glibc's default heap, which the memory tests
    measure under."""
    variables = {**os.environ, "OMP_NUM_THREADS": "1"}
    if recipe:
        script = str(RECIPES / "grpo.py")
        restart = huge_page_restart(
            environ=variables,
            argv=[script],
            orig_argv=[sys.executable, script],
            mode=thp_mode(),
            libc=platform.libc_ver()[0],
        )
        if restart is not None:
            variables = restart[1]
    return variables


def torchrun(
    program: str,
    *args: str,
    nproc: int = 4,
    timeout: float = 180,
    cwd: str | None = None,
    monitor_interval_s: float | None = None,
    recipe: bool = False,
    forked: bool = False,
) -> subprocess.CompletedProcess:
    """One torchrun agent with ``nproc`` ranks; stdout and stderr together in ``.stdout``. ``recipe``: the program
    runs a recipe's entry (``environment``). ``forked``: the ranks are forks of this process's preloaded interpreter
    with torchrun's variables for one node instead (``preloaded.py``: no agent, no imports per rank), for a program
    whose results are tested, not how its job ends under faults nor its heap (the server's is a recipe's)."""
    if forked:
        program_argv = [str(program_path(program)), *args]
        directory = Path(cwd) if cwd is not None else Path.cwd()
        return _preloaded().run(
            program_argv, cwd=directory, timeout=timeout, nproc=nproc, env=environment(recipe=recipe)
        )
    command = torchrun_command(program, *args, nproc=nproc, port=free_port(), monitor_interval_s=monitor_interval_s)
    return subprocess.run(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env=environment(recipe=recipe),
        cwd=cwd,
    )


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SHARED_TINY: list[Path] = []
"""The ``tiny/`` assets the first recipe run of this process built on first use, which later runs share (the same
model and task: they are built from fixed seeds)."""


@functools.cache
def _preloaded():
    """This test process's ``preloaded.PreloadedPython``, started on first use (its imports once, about 4 s of CPU),
    ended when the process ends (its input closes)."""
    from preloaded import PreloadedPython

    return PreloadedPython()


def run_recipe(name: str, workdir: Path, *overrides: str, nproc: int = 2, under_torchrun: bool = False) -> list[dict]:
    """Run recipes/<name>.py with its default config on ``nproc`` ranks in ``workdir`` and ``trainer.output_dir=out``;
    returns the metrics records of ``workdir/out/metrics.jsonl``. The first run of this process builds the tiny assets
    in its ``workdir`` on first use; a later run in a new ``workdir`` links to them (about 1.5 s saved each). The ranks
    are forks of a process that has imported the package (``preloaded.py``), as torchrun would start them on one node
    but without its agent and each rank's imports (about 4 s of CPU a rank and 1.3 s an agent): these tests are of
    the recipes' results; those of how a job ends under faults start torchrun themselves. ``under_torchrun``: a
    torchrun agent starts the ranks, as the README's main job does."""
    workdir.mkdir(parents=True, exist_ok=True)
    tiny = workdir / "tiny"
    builds_tiny = not tiny.exists() and not SHARED_TINY  # a test may have put its own assets there
    if SHARED_TINY and not tiny.exists():
        tiny.symlink_to(SHARED_TINY[0], target_is_directory=True)
    argv = [
        str(RECIPES / f"{name}.py"),
        "--config",
        str(RECIPES / "configs" / f"{name}.yaml"),
        "trainer.output_dir=out",
    ]
    finished = torchrun(
        *argv, *overrides, nproc=nproc, timeout=300, cwd=str(workdir), recipe=True, forked=not under_torchrun
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    if builds_tiny and tiny.is_dir():
        SHARED_TINY.append(tiny)
    return [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]


def hf_weights(directory: str | Path) -> dict:
    """Every tensor of a Hugging Face directory a test program wrote: one ``model.safetensors``, or several files
    and an index (a pipeline-parallel role writes one file per stage)."""
    from safetensors.torch import load_file

    from spmd_rlhf.models.weights import checkpoint_files

    files = set(checkpoint_files(str(directory)).values())
    return {name: tensor for file in sorted(files) for name, tensor in load_file(file).items()}
