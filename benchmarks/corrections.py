"""What each rollout correction costs on the tiny task: GRPO with every ``algorithm.correction.preset`` (and none) at
``max_staleness`` 0 (engine vs trainer, log-probs recomputed) and 2 (two batches in flight on a rollout role), same
model, prompts and seed.

    python benchmarks/corrections.py [--steps 30] [--presets none,decoupled_token_is,...] [--staleness 0,2]

Each run is ``recipes/grpo.py`` under ``torch.distributed.run`` in a fresh temporary directory (the recipe builds the
tiny task there): k = 0 on 2 ranks, colocated, with ``rollout.recompute_log_probs=true``; k = 2 on 4 ranks (2 training,
2 rollout replicas beside the rule reward). Per run: the mean reward of the first and last five steps, the mean share
of tokens and responses the correction rejected, the largest importance weight seen, and the mean log-prob gap and
k3 KL between pi_old and the engine. Writes ``benchmarks/results/corrections.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("none", "disabled", "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs")
PRESETS += ("token_is_rs", "icepop")


def run(preset: str, staleness: int, steps: int) -> dict:
    overrides = [f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.save_every=1000"]
    overrides += [] if preset == "none" else [f"algorithm.correction.preset={preset}"]
    if staleness:
        overrides += ["placement=split", "rollout.n_ranks=2", f"algorithm.max_staleness={staleness}"]
    else:
        overrides += ["rollout.recompute_log_probs=true"]
    nproc = 4 if staleness else 2
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            str(ROOT / "recipes" / "grpo.py"),
            "--config",
            str(ROOT / "recipes" / "configs" / "grpo.yaml"),
            "trainer.output_dir=out",
            *overrides,
        ]
        started = time.monotonic()
        finished = subprocess.run(
            command, cwd=workdir, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        if finished.returncode:
            raise RuntimeError(f"{preset} k={staleness} failed:\n{(finished.stdout + finished.stderr)[-3000:]}")
        records = [json.loads(line) for line in (Path(workdir) / "out" / "metrics.jsonl").read_text().splitlines()]
    corrected = [record for record in records if "off_policy/rejected_token_fraction" in record]

    def mean(key: str, rows: list[dict]) -> float | None:
        return sum(row[key] for row in rows) / len(rows) if rows else None

    return {
        "preset": preset,
        "max_staleness": staleness,
        "steps": steps,
        "seconds": round(time.monotonic() - started, 1),
        "reward_first5": mean("reward/mean", records[:5]),
        "reward_last5": mean("reward/mean", records[-5:]),
        "rejected_token_fraction": mean("off_policy/rejected_token_fraction", corrected),
        "rejected_sequence_fraction": mean("off_policy/rejected_sequence_fraction", corrected),
        "truncated_token_fraction": mean("off_policy/truncated_token_fraction", corrected),
        "importance_weight_max": max((row["off_policy/importance_weight_max"] for row in corrected), default=None),
        "log_prob_gap_mean": mean("off_policy/log_prob_gap_mean", corrected),
        "kl_k3": mean("off_policy/kl_k3", corrected),
    }


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--staleness", default="0,2")
    args = parser.parse_args()
    results = []
    output = ROOT / "benchmarks" / "results" / "corrections.json"
    for staleness in (int(value) for value in args.staleness.split(",")):
        for preset in args.presets.split(","):
            results.append(run(preset, staleness, args.steps))
            print(json.dumps(results[-1]), flush=True)
            output.write_text(json.dumps(results, indent=1) + "\n")
    print(
        "| k | preset | reward first 5 → last 5 | rejected tokens | rejected responses | truncated | max weight "
        "| gap | k3 KL | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['max_staleness']} | {row['preset']} | {fmt(row['reward_first5'])} → {fmt(row['reward_last5'])} "
            f"| {fmt(row['rejected_token_fraction'])} | {fmt(row['rejected_sequence_fraction'])} "
            f"| {fmt(row['truncated_token_fraction'])} | {fmt(row['importance_weight_max'], 4)} "
            f"| {fmt(row['log_prob_gap_mean'])} | {fmt(row['kl_k3'])} | {row['seconds']} |"
        )


if __name__ == "__main__":
    main()
