"""Throughput of the code-execution reward: short correct programs scored per second by ``RewardRunner``.

    python benchmarks/code_reward.py [--programs 40] [--tests 3] [--workers 2]

Each program reads two numbers and prints their sum; its row holds ``--tests`` stdin/stdout tests, each run in its
own sandboxed interpreter (``rewards.code``). One untimed batch starts the pool first, so the figure is the steady
state a training run sees. Prints programs/s and tests/s.
"""

from __future__ import annotations

import argparse
import os
import time

from spmd_rlhf.rewards import RewardRow, RewardRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=40)
    parser.add_argument("--tests", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    tests = {
        "inputs": [f"{index} {index + 1}\n" for index in range(args.tests)],
        "outputs": [f"{2 * index + 1}\n" for index in range(args.tests)],
    }
    rows = [
        RewardRow("code", f"```python\na, b = map(int, input().split())\nprint(a + b + {index} * 0)\n```", tests, {})
        for index in range(args.programs)
    ]
    runner = RewardRunner("code", num_workers=args.workers, timeout_s=60)
    try:
        runner.score(rows[: args.workers])
        start = time.perf_counter()
        result = runner.summarize(runner.score(rows))
        seconds = time.perf_counter() - start
    finally:
        runner.close()
    if result.scores != [1.0] * args.programs:
        raise SystemExit(f"expected every program to pass; scores {result.scores}")
    cpus = len(os.sched_getaffinity(0))
    print(
        f"{args.programs} programs x {args.tests} tests, {args.workers} workers, {cpus} usable CPUs "
        f"(load average {os.getloadavg()[0]:.1f}): {seconds:.2f} s, {args.programs / seconds:.1f} programs/s, "
        f"{args.programs * args.tests / seconds:.1f} tests/s"
    )


if __name__ == "__main__":
    main()
