"""The benchmarks' training jobs as processes: how a job of N processes starts, running it with its output in a log
(and each process's peak memory), and the per-step summary every end-to-end comparison reports for each side."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

from process_memory import run_with_peak_rss

from spmd_rlhf.runtime.host_memory import TUNABLE

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo.py"
RECIPE_CONFIG = ROOT / "recipes" / "configs" / "grpo.yaml"


def step_summary(
    *,
    launch: str,
    wall_s: float,
    samples: int,
    step_s: list[float],
    generated: list[float],
    reward: list[float],
    stages: dict[str, list[float]],
    peak_rss: list[int] | None = None,
) -> dict:
    """Per-step medians (robust to a busy neighbour on a shared machine) and the rates they give; with ``peak_rss``
    (bytes, one per process) the largest and all of them in GiB."""
    step = statistics.median(step_s)
    memory = (
        {}
        if peak_rss is None
        else {
            "peak_rss_gib_per_process": [peak / 2**30 for peak in peak_rss],
            "peak_rss_gib": max(peak_rss) / 2**30,
        }
    )
    return {
        "launch": launch,
        "measured_steps": len(step_s),
        "wall_s_with_startup": wall_s,
        "step_s": step,
        "step_s_mean": statistics.fmean(step_s),
        "steps_per_s": 1 / step,
        "samples_per_s": samples / step,
        "generated_tokens_per_step": statistics.fmean(generated),
        "generated_tokens_per_s": statistics.fmean(generated) / step,
        "reward_mean": statistics.fmean(reward),
        "stage_s": {name: statistics.median(seconds) for name, seconds in stages.items()},
        **memory,
    }


def run_job(command: list[str], *, cwd: str, threads: int, log: Path, env: dict[str, str] | None = None) -> float:
    """Run ``command`` with ``threads`` OpenMP threads per process (and ``env`` over this one's environment), output
    to ``log``; wall seconds. Fails loudly."""
    return run_job_measured(command, cwd=cwd, threads=threads, log=log, env=env)[0]


def run_job_measured(
    command: list[str],
    *,
    cwd: str,
    threads: int,
    log: Path,
    huge_pages: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[float, list[int]]:
    """``run_job``, also giving the peak resident set size in bytes of every process the command started
    (``process_memory.run_with_peak_rss``); wall seconds and those peaks. ``huge_pages``: start the processes with
    glibc's huge-page tunable, as spmd_rlhf's CPU ranks give themselves (``runtime.host_memory``)."""
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if huge_pages:
        environment["GLIBC_TUNABLES"] = f"{TUNABLE}=1"
    started = time.perf_counter()
    with open(log, "w") as out:
        returncode, peaks = run_with_peak_rss(command, cwd=cwd, env=environment, stdout=out)
    seconds = time.perf_counter() - started
    if returncode:
        tail = log.read_text().splitlines()[-80:]
        raise RuntimeError(f"{' '.join(command)} exited with {returncode}; last lines of {log}:\n" + "\n".join(tail))
    return seconds, peaks


def launcher(nproc: int) -> list[str]:
    """How a job of ``nproc`` processes starts: one runs as a plain ``python`` process (the recipes and TRL set up a
    one-process group themselves), without torchrun's agent, its own interpreter's seconds of imports and its polling;
    more under torchrun on this node."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def launched(nproc: int) -> str:
    """``launcher``'s launch in words, for the result's ``launch``."""
    return "1 process" if nproc == 1 else f"torchrun, {nproc} processes"
