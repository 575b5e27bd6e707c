"""Where a GRPO step's time goes on CPU, per rank and per stage: the ``e2e_cpu.py`` recipe run sampled by py-spy.

    pip install py-spy                 # a sampling profiler: no change to the code it watches
    python benchmarks/profile_cpu.py [--config tiny|tiny_gen32|small_gen32|small_gen64|qwen05b] [--steps 40]

Runs the GRPO recipe of ``e2e_cpu.py``'s named config (same model, task and sizes) on ``--nproc`` ranks under
``py-spy record --subprocesses --nonblocking`` (``--rate`` samples per second per thread, idle threads left out; the
processes are never paused, so the ranks' collectives are not held up by the sampling), then attributes
each sample of each rank's executor thread (where every role method runs) to the worker method it is in (the stage)
and to what the innermost frames are doing:

- ``collective``: a ``torch.distributed`` collective or point-to-point transfer, waiting for the other ranks included
  (so a rank that arrives early shows the other's lateness here);
- ``model``: the model's and the optimizer's own code (torch.nn modules, autograd's backward, the optimizer step, the
  log-prob and loss functions);
- ``fsdp``: FSDP2's hooks around the model, outside its collectives;
- ``engine``: the generation engine's Python (scheduler, block manager, input building, sampler);
- ``runtime``: commands, transfers and batches (executor, payloads, the ``Batch`` type);
- ``other``: the rest of the worker methods (metrics, rule rewards, building outputs).

Prints, per rank, each stage's median time per step (the recipe's own timers, first step left out) split in
milliseconds by the categories' shares of that stage's samples, and each stage's most frequent innermost frames.
Writes ``benchmarks/results/profile_cpu_<config>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from e2e_cpu import CONFIGS, benchmark_spec, build_model, spmd_command

CATEGORIES = ("collective", "model", "fsdp", "engine", "runtime", "other")
_COLLECTIVE = re.compile(
    r"^(all_gather\w*|all_reduce|reduce_scatter\w*|broadcast\w*|barrier|send|recv|isend|irecv|batch_isend_irecv|"
    r"gather_object|scatter\w*|all_to_all\w*|_wait_all) \(torch/distributed/distributed_c10d.py|^_wait_all \("
)
_STAGE = re.compile(r"^(\w+Worker)\.(\w+) \(")


def category(frames: list[str]) -> str:
    """The category of one sample from its frames, outermost first (see the module docstring)."""
    for frame in reversed(frames):
        if _COLLECTIVE.search(frame):
            return "collective"
    innermost = next((frame for frame in reversed(frames) if "(" in frame), "")
    path = innermost[innermost.rfind("(") + 1 :]
    if "spmd_rlhf/engine/" in path:
        return "engine"
    if "torch/distributed/fsdp/" in path:
        return "fsdp"
    if any(
        part in path
        for part in (
            "torch/nn/",
            "torch/autograd/",
            "torch/optim/",
            "torch/_tensor",
            "spmd_rlhf/models/",
            "spmd_rlhf/algos/",
            "torch/functional",
            "torch/utils/checkpoint",
            "torch/_ops",
        )
    ):
        return "model"
    if any(
        part in path for part in ("spmd_rlhf/runtime/", "spmd_rlhf/data/", "threading.py", "torch/futures", "pickle")
    ):
        return "runtime"
    return "other"


STAGE_TIMERS = {
    "ActorWorker.generate_sequences": "generate",
    "ActorWorker.update_actor": "update_actor",
    "ActorWorker.compute_log_probs": "old_log_probs",
    "ReferenceWorker.compute_log_probs": "ref_log_probs",
    "RewardWorker.compute_rewards": "reward",
    "ActorWorker.compute_advantages": "advantages",
}
"""The worker methods of a GRPO step -> the recipe's stage timer (``time/<name>`` in metrics.jsonl)."""


def attribute(raw: str) -> tuple[dict[str, dict[str, dict[str, int]]], dict[str, dict[str, int]]]:
    """Samples per thread label (``rank N`` for executors, ``coordinator``), stage and category, from py-spy's raw
    output (one ``frame;frame;... count`` line per distinct stack); and per stage, samples per innermost frame."""
    table: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    frames_by_stage: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = next((frame for frame in frames if frame.startswith("thread ")), "")
        frames = [re.sub(r":\d+\)", ")", frame) for frame in frames if not frame.startswith(("process ", "thread "))]
        executor = re.search(r"spmd-executor-rank(\d+)", thread)
        if executor:
            label = f"rank {executor.group(1)}"
            stage = next((f"{m.group(1)}.{m.group(2)}" for frame in frames if (m := _STAGE.match(frame))), None)
            if stage is None:
                stage = "idle" if any(frame.startswith("Condition.wait") for frame in frames) else "executor"
        elif any(frame.startswith("RLRecipe.train_steps") for frame in frames):
            label, stage = "coordinator", "step loop"
        else:
            continue
        table[label][stage][category(frames) if stage not in ("idle", "step loop") else "runtime"] += int(count)
        if frames:
            frames_by_stage[stage][frames[-1]] += int(count)
    return table, frames_by_stage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    spec = benchmark_spec(args.config, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="profile_cpu_") as directory:
        workdir = Path(directory)
        build_model(spec, workdir)
        out_dir, raw_path = workdir / "run", workdir / "py-spy.txt"
        # --nonblocking: py-spy reads the stacks without pausing the processes, which would otherwise hold up
        # their peers inside every collective.
        command = [
            py_spy,
            "record",
            "--subprocesses",
            "--threads",
            "--nonblocking",
            "--rate",
            str(args.rate),
            "--format",
            "raw",
            "--output",
            str(raw_path),
            "--",
            *spmd_command(spec, out_dir=out_dir, nproc=args.nproc),
        ]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(workdir / "run.log", "w") as log:
            finished = subprocess.run(command, cwd=workdir, env=environment, stdout=log, stderr=subprocess.STDOUT)
        if finished.returncode:
            tail = (workdir / "run.log").read_text().splitlines()[-60:]
            raise SystemExit(f"the profiled run failed ({finished.returncode}):\n" + "\n".join(tail))
        steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
        table, frames_by_stage = attribute(raw_path.read_text())
    # py-spy's sample counts give each stage's split; the recipe's own timers give its length (median per step), so
    # a sampler that falls behind on a large process skews no absolute number.
    measured = [row for row in steps[1:]] or steps
    stage_s = {
        stage: sorted(row.get(f"time/{timer}", 0.0) for row in measured)[len(measured) // 2]
        for stage, timer in STAGE_TIMERS.items()
    }
    step_s = sorted(row["time/step"] for row in measured)[len(measured) // 2]
    print(
        f"GRPO `{args.config}` on {args.nproc} CPU ranks, {len(steps)} steps (median {step_s:.3f} s/step after the "
        f"first): each stage's median time per step split by what py-spy ({args.rate} Hz) saw, in ms\n"
    )
    print("| thread | stage | " + " | ".join(CATEGORIES) + " | total |")
    print("| --- | --- |" + " ---: |" * (len(CATEGORIES) + 1))
    result: dict = {}
    for label in sorted(name for name in table if name != "coordinator"):
        for stage, counts in sorted(table[label].items(), key=lambda item: -stage_s.get(item[0], 0.0)):
            total = sum(counts.values())
            if stage not in stage_s or not total or not stage_s[stage]:
                continue
            values = [1000 * stage_s[stage] * counts.get(name, 0) / total for name in CATEGORIES]
            result.setdefault(label, {})[stage] = dict(zip(CATEGORIES, values))
            print(
                f"| {label} | {stage} | " + " | ".join(f"{value:.1f}" for value in values) + f" | {sum(values):.1f} |"
            )
    top_frames = {
        stage: {
            frame: count / sum(counts.values())
            for frame, count in sorted(counts.items(), key=lambda item: -item[1])[:15]
        }
        for stage, counts in frames_by_stage.items()
        if stage in stage_s
    }
    print("\nInnermost frames of each stage (share of its samples, all ranks):")
    for stage, frames in top_frames.items():
        print(f"- {stage}: " + "; ".join(f"{frame} {share:.0%}" for frame, share in list(frames.items())[:6]))
    os.makedirs(args.out, exist_ok=True)
    out_file = Path(args.out) / f"profile_cpu_{args.config}.json"
    out_file.write_text(
        json.dumps(
            {
                "config": args.config,
                "spec": spec,
                "nproc": args.nproc,
                "steps": len(steps),
                "step_s": step_s,
                "stage_s": stage_s,
                "rate": args.rate,
                "ms_per_step": result,
                "top_frames": top_frames,
                "command": f"python benchmarks/profile_cpu.py --config {args.config} --nproc {args.nproc} "
                f"--steps {args.steps}",
            },
            indent=2,
        )
    )
    print(f"\nwrote {out_file}")


if __name__ == "__main__":
    sys.exit(main())
