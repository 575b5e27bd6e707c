"""Asynchronous GRPO on CPU ranks: colocated synchronous, split synchronous (a rollout role, max_staleness=0),
one-step-off (k=1), k=2, k=2 with the weights sent from a background thread (rollout.background_sync) and k=2 with
partial rollouts (rollout.partial_rollouts=keep_kv), same model, prompts and seed.

    python benchmarks/async_cpu.py [--nproc 4] [--rollout-ranks 2] [--steps 40] [--warmup 4] [key=value ...]

Each run is ``recipes/grpo.py`` under ``torch.distributed.run`` in a fresh temporary directory (the recipe builds the
tiny task there), one OpenMP thread per rank; the runs take turns, never overlapping. The default overrides give
longer responses than grpo.yaml (``rollout.max_new_tokens=16``, 8 samples per prompt), so generation and training take
comparable time; pass ``key=value`` overrides to change the shape. The colocated run puts every role on all ranks; the
split runs put the actor and reference on ``nproc - rollout_ranks`` ranks and the rollout replicas beside the rule
reward on the others.

Per run: the median step time after ``--warmup`` steps, steps/s and samples/s (responses trained per second), the
median weight sync (``time/weight_sync``: the controller's view, from issuing the sync until both sides are done,
so it includes any wait for the rollout to finish the generation queued before it, except with background_sync,
where it is the actor's copy of its shards; and bytes) against its bandwidth
bound (bytes / the gloo broadcast rate measured here between
two processes with the same bytes), and reward against samples seen (the mean reward of each quarter of the run).
Speed-ups are against the colocated synchronous run of the same invocation. Writes ``benchmarks/results/async_cpu.json``
and prints a markdown table. On a shared machine the figures are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from spmd_rlhf.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE, CONFIG = ROOT / "recipes" / "grpo.py", ROOT / "recipes" / "configs" / "grpo.yaml"
SHAPE = (
    "rollout.max_new_tokens=16",
    "rollout.n=8",
    "actor.mini_batch_size=64",
    "actor.micro_batch_size=16",
    "reference.micro_batch_size=16",
    "trainer.val_every=0",
    "trainer.save_every=100000",
)
MODES = {
    "colocated_sync": ("placement=colocate",),
    "split_sync": ("placement=split", "rollout.enabled=true"),
    "split_k1": (
        "placement=split",
        "rollout.enabled=true",
        "algorithm.max_staleness=1",
        "rollout.recompute_log_probs=true",
    ),
    "split_k2": (
        "placement=split",
        "rollout.enabled=true",
        "algorithm.max_staleness=2",
        "rollout.recompute_log_probs=true",
    ),
    "split_k2_background": (
        "placement=split",
        "rollout.enabled=true",
        "algorithm.max_staleness=2",
        "rollout.recompute_log_probs=true",
        "rollout.background_sync=true",
    ),
    "split_k2_partial": (
        "placement=split",
        "rollout.enabled=true",
        "algorithm.max_staleness=2",
        "rollout.recompute_log_probs=true",
        "rollout.partial_rollouts=keep_kv",
    ),
}


def run_mode(
    mode: str, *, nproc: int, rollout_ranks: int, steps: int, overrides: list[str], workdir: Path
) -> list[dict]:
    """The metrics records of one run of ``mode``."""
    split = [f"rollout.n_ranks={rollout_ranks}"] if mode != "colocated_sync" else []
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(RECIPE),
        "--config",
        str(CONFIG),
        "trainer.output_dir=out",
        f"trainer.total_steps={steps}",
        *SHAPE,
        *MODES[mode],
        *split,
        *overrides,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    workdir.mkdir(parents=True)
    with open(workdir / "log", "w") as log:
        finished = subprocess.run(
            command, cwd=workdir, env=environment, stdout=log, stderr=subprocess.STDOUT, timeout=3600
        )
    if finished.returncode:
        raise RuntimeError(f"{mode} exited with {finished.returncode}:\n" + (workdir / "log").read_text()[-4000:])
    return [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]


def _broadcast_rate(rank: int, port: int, num_bytes: int, rounds: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.zeros(num_bytes // 4)
    dist.broadcast(buffer, src=0)  # connect first
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        dist.broadcast(buffer, src=0)
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    if rank == 0:
        result.put(num_bytes / statistics.median(seconds))
    dist.destroy_process_group()


def gloo_link_rate(num_bytes: int, rounds: int = 5) -> float:
    """Bytes per second of a gloo broadcast of ``num_bytes`` from one process to another on this machine."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    result = context.Queue()
    processes = [
        context.Process(target=_broadcast_rate, args=(rank, port, num_bytes, rounds, result)) for rank in (0, 1)
    ]
    for process in processes:
        process.start()
    rate = result.get(timeout=600)
    for process in processes:
        process.join(timeout=60)
    return rate


def summarise(records: list[dict], *, warmup: int, link_rate: float | None) -> dict:
    measured = records[warmup:]
    step = statistics.median(record["time/step"] for record in measured)
    summary = {"step_s": step, "steps_per_s": 1 / step}
    syncs = [record["time/weight_sync"] for record in measured if "time/weight_sync" in record]
    if syncs:
        sync_bytes = next(record["weight_sync/bytes"] for record in measured if "weight_sync/bytes" in record)
        summary.update({"weight_sync_s": statistics.median(syncs), "weight_sync_bytes": sync_bytes})
        if link_rate:
            summary["weight_sync_bound_s"] = sync_bytes / link_rate
    quarter = max(1, len(records) // 4)
    summary["reward_by_quarter"] = [
        statistics.fmean(record["reward/mean"] for record in records[start : start + quarter])
        for start in range(0, len(records), quarter)
    ]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rollout-ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    options = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for mode in options.modes:
            records = run_mode(
                mode,
                nproc=options.nproc,
                rollout_ranks=options.rollout_ranks,
                steps=options.steps,
                overrides=options.overrides,
                workdir=Path(root) / mode,
            )
            results[mode] = records
    sync_bytes = next((r["weight_sync/bytes"] for rs in results.values() for r in rs if "weight_sync/bytes" in r), None)
    link_rate = gloo_link_rate(int(sync_bytes)) if sync_bytes else None
    load = os.getloadavg()
    table = {mode: summarise(records, warmup=options.warmup, link_rate=link_rate) for mode, records in results.items()}

    config = load_config(CONFIG, [*SHAPE, *options.overrides])
    samples_per_step = config.data.batch_size * config.rollout.n
    base = table.get("colocated_sync")
    for summary in table.values():
        summary["samples_per_s"] = samples_per_step / summary["step_s"]
        if base:
            summary["speedup_vs_colocated_sync"] = base["step_s"] / summary["step_s"]
    report = {
        "nproc": options.nproc,
        "rollout_ranks": options.rollout_ranks,
        "steps": options.steps,
        "warmup": options.warmup,
        "overrides": [*SHAPE, *options.overrides],
        "samples_per_step": samples_per_step,
        "gloo_broadcast_bytes_per_s": link_rate,
        "load_average_after": load,
        "runs": table,
    }
    suffix = "" if (options.nproc, options.rollout_ranks) == (4, 2) else f"_{options.nproc}ranks"
    out = ROOT / "benchmarks" / "results" / f"async_cpu{suffix}.json"
    out.write_text(json.dumps(report, indent=2))
    print("| run | step s | steps/s | samples/s | vs colocated | weight sync s | bound s | reward by quarter |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for mode, summary in table.items():
        sync = summary.get("weight_sync_s")
        bound = summary.get("weight_sync_bound_s")
        print(
            f"| {mode} | {summary['step_s']:.3f} | {summary['steps_per_s']:.2f} | {summary['samples_per_s']:.1f} | "
            f"{summary.get('speedup_vs_colocated_sync', 1.0):.2f}x | {'' if sync is None else f'{sync:.4f}'} | "
            f"{'' if bound is None else f'{bound:.4f}'} | "
            f"{', '.join(f'{value:.3f}' for value in summary['reward_by_quarter'])} |"
        )
    print(f"\nwrote {out}; load average after: {load}")


if __name__ == "__main__":
    main()
