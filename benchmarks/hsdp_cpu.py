"""Hybrid sharding on CPU ranks: the GRPO recipe of ``e2e_cpu.py``'s named config run with FSDP over every rank and
again with HSDP settings given as overrides (by default ``reference.fsdp_size=1``: the frozen reference replicated,
so its forward gathers nothing), same model, task and steps, one after the other on the same cores.

    python benchmarks/hsdp_cpu.py [--config tiny|small_gen32|qwen05b] [--steps 4] [--warmup 1] [--nproc 2] \\
        [--hybrid reference.fsdp_size=1 ...]

Prints per-step medians (after ``--warmup``) of the step, the reference's log-prob pass and the actor's update for
both runs, their ratios (hybrid / sharded: below 1 is faster), and each run's largest process peak resident set
size. A CPU run says what the sharding costs in gloo's collectives and FSDP's copies on these cores, not what it
saves on a network between nodes (the device mapper's cost model estimates that). Writes
``benchmarks/results/hsdp_cpu_<config>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchmark_jobs import run_job_measured  # noqa: E402
from e2e_cpu import CONFIGS, benchmark_spec, build_model, spmd_command  # noqa: E402

STAGES = ("step", "ref_log_probs", "update_actor")


def run(spec: dict, overrides: list[str], *, workdir: Path, name: str, nproc: int, warmup: int) -> dict:
    """The recipe with ``overrides``; the medians of ``STAGES`` (seconds) and the largest process's peak RSS (GiB)."""
    out_dir = workdir / name
    command = spmd_command(spec, out_dir=out_dir, nproc=nproc) + overrides
    _, peak_rss = run_job_measured(command, cwd=str(workdir), threads=1, log=workdir / f"{name}.log")
    with open(out_dir / "metrics.jsonl") as lines:
        steps = [json.loads(line) for line in lines][warmup:]
    medians = {stage: statistics.median(row[f"time/{stage}"] for row in steps) for stage in STAGES}
    return {"overrides": overrides, "seconds": medians, "peak_rss_gib": max(peak_rss) / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small_gen32", choices=sorted(CONFIGS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hybrid", nargs="+", default=["reference.fsdp_size=1"], help="the HSDP run's overrides")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        raise ValueError(f"--steps={args.steps} leaves nothing after --warmup={args.warmup}; use more steps")
    spec = benchmark_spec(args.config, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="hsdp_cpu_") as directory:
        workdir = Path(directory)
        build_model(spec, workdir)
        runs = {}
        for name, overrides in (("sharded", []), ("hybrid", list(args.hybrid))):
            print(f"{name}: {args.steps} steps on {args.nproc} ranks {' '.join(overrides)}", flush=True)
            runs[name] = run(spec, overrides, workdir=workdir, name=name, nproc=args.nproc, warmup=args.warmup)
    ratios = {stage: runs["hybrid"]["seconds"][stage] / runs["sharded"]["seconds"][stage] for stage in STAGES}
    print(
        f"\n| {args.config}, {args.nproc} ranks | " + " | ".join(f"{stage} s" for stage in STAGES) + " | peak RSS GiB |"
    )
    print("| --- |" + " --- |" * (len(STAGES) + 1))
    for name, result in runs.items():
        cells = " | ".join(f"{result['seconds'][stage]:.3f}" for stage in STAGES)
        print(f"| {name} {' '.join(result['overrides'])} | {cells} | {result['peak_rss_gib']:.2f} |")
    print("| hybrid / sharded | " + " | ".join(f"{ratios[stage]:.2f}" for stage in STAGES) + " | |")
    result = {
        "config": args.config,
        "nproc": args.nproc,
        "steps": args.steps,
        "warmup": args.warmup,
        "runs": runs,
        "ratios": ratios,
        "command": f"python benchmarks/hsdp_cpu.py --config {args.config} --nproc {args.nproc} --steps {args.steps} "
        f"--warmup {args.warmup} --hybrid {' '.join(args.hybrid)}",
    }
    out = Path(args.out) / f"hsdp_cpu_{args.config}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
