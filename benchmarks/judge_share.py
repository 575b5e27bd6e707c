"""The generative judge's share of a GRPO step at the tiny size: the GRPO recipe on 2 CPU ranks with its rule reward
(the baseline, run first in the same process) and with ``reward.kind=generative`` (a random judge of the tiny
policy's shape, qwen2 hidden 64 x 2 with its own ChatML tokenizer, on the reward role's ranks colocated with the
actor), the same steps and seeds.

    python benchmarks/judge_share.py [--steps 8] [--warmup 2] [--judge-tokens 16]

Prints, over the steps after ``--warmup``, the median step time of each run, the judge's median seconds per step
(``reward/judge_seconds``: its slowest DP rank, from the first prompt built to the last verdict parsed) and tokens,
its share of the judged step, and the judged step over the baseline step; writes
``benchmarks/results/judge_share.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe(workdir: Path, name: str, steps: int, *overrides: str) -> list[dict]:
    """The metrics records of ``steps`` GRPO steps run in ``workdir`` (the tiny assets are built there once), writing
    to ``workdir/name``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "recipes" / "grpo.py"),
        "--config",
        str(ROOT / "recipes" / "configs" / "grpo.yaml"),
        f"trainer.output_dir={name}",
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        *overrides,
    ]
    finished = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if finished.returncode:
        raise SystemExit(finished.stdout[-4000:] + finished.stderr[-4000:])
    return [json.loads(line) for line in (workdir / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--judge-tokens", type=int, default=16, help="reward.judge_max_new_tokens")
    args = parser.parse_args()

    from spmd_rlhf.tiny.model import make_tiny

    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        judge = make_tiny(family="qwen2", out_dir=str(workdir / "judge"), seed=3)
        baseline = recipe(workdir, "rule", args.steps)[args.warmup :]
        judged = recipe(
            workdir,
            "judge",
            args.steps,
            "reward.kind=generative",
            f"reward.model_path={judge}",
            f"reward.judge_max_new_tokens={args.judge_tokens}",
            "reward.max_failure_fraction=1.0",  # a random judge's verdicts rarely parse
        )[args.warmup :]
    baseline_step = statistics.median(record["time/step"] for record in baseline)
    judged_step = statistics.median(record["time/step"] for record in judged)
    judge_seconds = statistics.median(record["reward/judge_seconds"] for record in judged)
    result = {
        "steps_timed": len(judged),
        "responses_per_step": 8 * 16,
        "judge_max_new_tokens": args.judge_tokens,
        "judge_tokens_per_step": int(statistics.median(record["reward/judge_tokens"] for record in judged)),
        "baseline_step_s": baseline_step,
        "judged_step_s": judged_step,
        "judge_s": judge_seconds,
        "judge_share_of_step": judge_seconds / judged_step,
        "judged_over_baseline_step": judged_step / baseline_step,
    }
    (ROOT / "benchmarks" / "results" / "judge_share.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| measure | value |\n| --- | --- |")
    for key, value in result.items():
        print(f"| {key} | {value:.3g} |" if isinstance(value, float) else f"| {key} | {value} |")


if __name__ == "__main__":
    main()
