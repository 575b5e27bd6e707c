"""Does the device mapper rank mappings as they really run? Every feasible mapping of a recipe config, run for a
few steps on this machine, against the simulator's prediction from a calibrated profile.

    python benchmarks/mapping_validation.py [--config recipes/configs/ppo.yaml] [--nproc 4] [--steps 6] [--warmup 2]
                                            [--profile calibrate] [key=value ...]

1. The profile: ``calibrate`` measures this machine now (``spmd-rlhf calibrate``); or name one.
2. ``Planner.mappings()`` enumerates every placement x allocation that fits, each with its auto_parallel layouts,
   and predicts its step time (d_cost).
3. Each mapping runs as ``recipes/<algorithm>.py`` under ``torch.distributed.run --nproc-per-node N`` (one thread
   per rank) with the mapping written in as a manual placement; the measured step time is the median of the steps
   after ``--warmup``.
4. Reported: Spearman's rank correlation of predicted and measured step times, and whether the mapper's pick is
   within 10% of the fastest measured mapping. A benchmark, not a test: nothing here is asserted.

On a CPU machine the "devices" are processes sharing its cores, so mappings that overlap sets (split placements)
also compete for cores, which the cost model (one device per rank) does not see. Writes
``benchmarks/results/mapping_validation_<device>_<nproc>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.mapping.devices import Cluster
from spmd_rlhf.mapping.placement import config_dataflow, mapping_overrides
from spmd_rlhf.mapping.profile import load_profile
from spmd_rlhf.mapping.search import Planner

ROOT = Path(__file__).resolve().parents[1]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for position in range(start, end + 1):
                result[order[position]] = (start + end) / 2
            start = end + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mean_x, mean_y = statistics.fmean(rx), statistics.fmean(ry)
    covariance = sum((a - mean_x) * (b - mean_y) for a, b in zip(rx, ry))
    spread = (sum((a - mean_x) ** 2 for a in rx) * sum((b - mean_y) ** 2 for b in ry)) ** 0.5
    return covariance / spread if spread else float("nan")


def measure(
    recipe: Path, config_path: str, overrides: list[str], *, nproc: int, steps: int, warmup: int, scratch: Path
) -> dict[str, float]:
    """Median seconds of the step and of each stage (``time/*``) of the recipe (run from the checkout, where the tiny
    assets live) with ``overrides`` after ``warmup`` steps; its run directory goes under ``scratch``."""
    out_dir = scratch / f"run_{time.monotonic_ns()}"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(recipe),
        "--config",
        config_path,
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out_dir}",
        "trainer.loggers=[jsonl]",
        "trainer.save_every=0",
        "trainer.val_every=0",
        *overrides,
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900)
    if finished.returncode:
        raise RuntimeError(
            f"{' '.join(command)} exited with {finished.returncode}:\n"
            f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    return {
        key.removeprefix("time/"): statistics.median(row[key] for row in rows)
        for key in rows[0]
        if key.startswith("time/")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "ppo.yaml"))
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", default="calibrate", help="calibrate (measure now), h100, a100 or a profile file")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    config_path = str(Path(args.config).resolve())
    config = load_config(config_path, args.overrides)
    if args.profile == "calibrate":
        from spmd_rlhf.mapping.calibrate import calibrate

        profile = calibrate()
    else:
        profile = load_profile(args.profile)
    roles, batch = config_dataflow(config)
    planner = Planner(roles, Cluster(args.nproc, args.nproc, profile), batch)
    mappings = sorted(planner.mappings(), key=lambda mapping: mapping.seconds)
    grpo_recipe = ("rloo", "reinforce_pp", "reinforce_pp_baseline")
    recipe = ROOT / "recipes" / f"{'grpo' if config.algorithm.name in grpo_recipe else config.algorithm.name}.py"
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for mapping in mappings:
            overrides = [*args.overrides, *mapping_overrides(config, mapping)]
            times = measure(
                recipe,
                config_path,
                overrides,
                nproc=args.nproc,
                steps=args.steps,
                warmup=args.warmup,
                scratch=Path(scratch),
            )
            measured = times.pop("step")
            layouts = ", ".join(f"{name} {layout}" for name, layout in mapping.layouts.items())
            rows.append(
                {
                    "mapping": mapping.describe(),
                    "layouts": layouts,
                    "predicted_s": mapping.seconds,
                    "predicted_stage_s": mapping.stage_seconds,
                    "measured_s": measured,
                    "measured_stage_s": times,
                }
            )
            print(f"{mapping.describe():45s} predicted {mapping.seconds:.4f} s  measured {measured:.4f} s", flush=True)
    predicted = [row["predicted_s"] for row in rows]
    measured = [row["measured_s"] for row in rows]
    fastest = min(measured)
    pick = rows[0]["measured_s"]  # mappings are sorted by prediction: the first is the mapper's pick
    result = {
        "config": os.path.relpath(config_path, ROOT),
        "overrides": args.overrides,
        "nproc": args.nproc,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile": json.loads(profile.to_json()),
        "mappings": rows,
        "spearman": spearman(predicted, measured),
        "pick_over_fastest": pick / fastest,
        "pick_within_10_percent": pick <= 1.1 * fastest,
        "device": "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python", *sys.argv]),
    }
    print("\n| mapping | layouts | predicted s | measured s |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['mapping']} | {row['layouts']} | {row['predicted_s']:.4f} | {row['measured_s']:.3f} |")
    print(
        f"\nSpearman rank correlation: {result['spearman']:.2f}; "
        f"pick / fastest measured: {result['pick_over_fastest']:.2f}"
    )
    out = ROOT / "benchmarks" / "results" / f"mapping_validation_cpu_{args.nproc}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
