"""Everything a machine with one GPU can tell us, in one command (``benchmarks/gpu_suite.sh`` calls this):

    bash benchmarks/gpu_suite.sh --part 1         # each part fits one 10-minute call on one H100 / H200
    bash benchmarks/gpu_suite.sh --part 2
    bash benchmarks/gpu_suite.sh --part 3
    python benchmarks/gpu_suite.py --only kernels g1 --out /tmp/suite
    python benchmarks/gpu_suite.py --smoke        # every step on tiny sizes, on CPU: checks the suite itself

Steps, in order, each a subprocess under its own time limit (a step that runs past it is killed and reported as
``timed_out``; steps that no longer fit in ``--budget-s`` are reported as ``skipped``, never dropped silently). With no
``--part`` or ``--only`` every step runs (about 25 minutes at real sizes: the first H100 session found that one
10-minute call holds about a third of it, hence the parts, ``PARTS``). G1, G2, G3 and G5 share one 1.5B-shaped model
directory under the suite's work directory, built by the first of them that runs.

| step | what | its own JSON |
| --- | --- | --- |
| ``cuda_tests`` | every test marked ``gpu`` (kernels at real sizes, engine and model parity on CUDA) \
| pytest's junit XML |
| ``kernels`` | both Triton kernels at real sizes against their torch references | ``gpu_kernels.py`` |
| ``g1`` | G1 decode vs the HBM floor (with a profile of one decode run) | ``gpu_generate.py --measure decode`` |
| ``g2`` | G2 engine vs ``transformers`` static-cache ``generate`` (whose compile takes minutes) \
| ``gpu_generate.py --measure batch`` |
| ``g3`` | ``update_actor`` MFU | ``gpu_update.py`` |
| ``g5`` | reshard train -> generation (one GPU: the copy bound, see its docstring) | ``gpu_reshard.py`` |
| ``scale`` | issue 17's per-stage peak memory (``max_memory_allocated``) vs the floor, GRPO at the 1.5B shape, \
1 rank | ``scale.py`` |
| ``g4`` | GRPO end to end against TRL ``GRPOTrainer`` | ``gpu_grpo.py`` |
| ``two_process`` | the GRPO recipe as a two-process torchrun job on the one device | the recipe's metrics |

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so on a one-GPU machine ``two_process`` is expected to
fail with that message, which the report then shows; on CPU (``--smoke``) it runs on gloo. Writes one JSON file,
``<out>/gpu_suite_<device>.json``, holding every step's status, time, headline figures and its full JSON, and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gpu_common import environment

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: int
    json_glob: str | None = None
    """Pattern (under the step's output directory) of the JSON the step writes."""
    headline: dict[str, str] = field(default_factory=dict)
    """Figure name -> dotted path into that JSON."""


def steps(python: str, smoke: bool, work: Path) -> list[Step]:
    """The suite's steps; ``--smoke`` passes ``--smoke`` to each benchmark and runs the recipe job on tiny sizes."""
    smoke_flag = ["--smoke"] if smoke else []
    out = lambda name: ["--out", str(work / name)]  # noqa: E731 (one line per step reads best)
    model = [] if smoke else ["--model-dir", str(work / "model_1.5b")]
    recipe_overrides = [
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.val_every=0",
        f"trainer.output_dir={work / 'two_process'}",
        "trainer.loggers=[jsonl]",
    ]
    return [
        Step(
            "cuda_tests",
            [python, "-m", "pytest", "-q", "-m", "gpu", "tests", f"--junitxml={work / 'cuda_tests.xml'}"],
            240,
        ),
        Step(
            "kernels",
            [python, str(BENCHMARKS / "gpu_kernels.py"), *smoke_flag, *out("kernels")],
            90,
            "*.json",
            {
                "paged_decode_speedup": "paged_decode.speedup",
                "paged_over_floor": "paged_decode.kernel_over_floor",
                "fused_speedup": "fused_logprob.speedup",
                "fused_peak_over_logits": "fused_logprob.kernel_peak_over_logits",
            },
        ),
        Step(
            "g1",
            [
                python,
                str(BENCHMARKS / "gpu_generate.py"),
                "--measure",
                "decode",
                *model,
                *smoke_flag,
                *out("g1"),
                "--profile",
                str(work / "g1" / "decode_profile.txt"),
            ],
            150,
            "*.json",
            {"G1_decode_over_floor": "decode.ratio_to_floor"},
        ),
        Step(
            "g2",
            [python, str(BENCHMARKS / "gpu_generate.py"), "--measure", "batch", *model, *smoke_flag, *out("g2")],
            420,
            "*.json",
            {"G2_speedup": "batch.speedup"},
        ),
        Step(
            "g3",
            [python, str(BENCHMARKS / "gpu_update.py"), *model, *smoke_flag, *out("g3")],
            150,
            "*.json",
            {"G3_mfu": "per_length.0.mfu", "G3_mfu_longest": "per_length.-1.mfu"},
        ),
        Step(
            "g5",
            [python, str(BENCHMARKS / "gpu_reshard.py"), *model, *smoke_flag, *out("g5")],
            90,
            "*.json",
            {
                "G5_ratio_to_bound": "results.*.ratio_to_bound",
                "G5_ratio_to_copy_bound": "results.*.ratio_to_copy_bound",
            },
        ),
        Step(
            "scale",
            [
                python,
                str(BENCHMARKS / "scale.py"),
                "--algo",
                "grpo",
                "--shape",
                "smoke" if smoke else "1.5b",
                "--nproc",
                "1",
                *model,
                *out("scale"),
            ],
            180,
            "*.json",
            {"scale_worst_peak_over_floor": "worst_peak_over_floor"},
        ),
        Step(
            "g4",
            [
                python,
                str(BENCHMARKS / "gpu_grpo.py"),
                *smoke_flag,
                *(["--steps", "4", "--warmup", "1"] if not smoke else []),
                *out("g4"),
            ],
            300,
            "*.json",
            {"G4_tokens_per_s_ratio": "tokens_per_s_ratio"},
        ),
        Step(
            "two_process",
            [
                python,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                str(ROOT / "recipes" / "grpo.py"),
                *recipe_overrides,
            ],
            180,
        ),
    ]


PARTS = {
    "1": ["cuda_tests", "kernels", "g1", "g3", "g5", "scale"],
    "2": ["g4", "two_process"],
    "3": ["g2"],
}
"""Groups of steps that each fit one 10-minute call at real sizes (each within the 570 s budget; measured on H100:
cuda_tests 50 s, kernels 17 s, G1 about 100 s with the model's build, G3 about 120 s, G5 40 s; scale not yet run)."""


def dig(value, path: str):
    """``value`` followed along ``a.b.0`` (list indices may be negative; ``*`` is a dict's first value); None where the
    path does not exist."""
    for key in path.split("."):
        try:
            if key == "*":
                value = next(iter(value.values()))
            else:
                value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError, AttributeError, StopIteration):
            return None
    return value


def junit_counts(path: Path) -> dict[str, int] | None:
    if not path.is_file():
        return None
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_step(step: Step, work: Path, remaining_s: float) -> dict:
    """Run one step under ``min(its limit, what is left of the budget)``; its status, time, output tail and figures."""
    if remaining_s < 10:
        return {"status": "skipped", "reason": "the suite's --budget-s ran out before this step"}
    limit = min(step.limit_s, remaining_s)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    try:
        finished = subprocess.run(
            step.command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=limit
        )
        status = "passed" if finished.returncode == 0 else "failed"
        output = finished.stdout
    except subprocess.TimeoutExpired as expired:
        status = "timed_out"
        output = (
            expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        )
    record = {
        "status": status,
        "seconds": round(time.perf_counter() - started, 1),
        "limit_s": limit,
        "command": " ".join(step.command),
        "output_tail": output[-3000:],
    }
    if step.json_glob:
        found = sorted((work / step.name).glob(step.json_glob))
        if found:
            record["result"] = json.loads(found[-1].read_text())
            record["figures"] = {name: dig(record["result"], path) for name, path in step.headline.items()}
    if step.name == "cuda_tests":
        record["tests"] = junit_counts(work / "cuda_tests.xml")
    return record


def table(report: dict) -> str:
    lines = [f"{'step':<12} {'status':<10} {'s':>7}  figures"]
    for name, record in report["steps"].items():
        figures = dict(record.get("figures") or {})
        if record.get("tests"):
            figures.update(record["tests"])
        shown = ", ".join(
            f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}" for key, value in figures.items()
        )
        seconds = f"{record['seconds']:.0f}" if "seconds" in record else "-"
        lines.append(f"{name:<12} {record['status']:<10} {seconds:>7}  {shown}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): checks the suite, measures nothing")
    parser.add_argument("--only", nargs="+", help="run only these steps")
    parser.add_argument(
        "--part", choices=sorted(PARTS), help="run one group of steps that fits a 10-minute call (PARTS)"
    )
    parser.add_argument("--budget-s", type=float, default=570.0, help="wall-clock budget for all steps together")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gpu_suite_"))
    if args.part and args.only:
        parser.error("give --part or --only, not both")
    wanted = PARTS[args.part] if args.part else args.only
    chosen = [step for step in steps(sys.executable, args.smoke, work) if not wanted or step.name in wanted]
    unknown = set(wanted or ()) - {step.name for step in steps(sys.executable, args.smoke, work)}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}")
    report = {"smoke": args.smoke, "environment": environment(device), "steps": {}}
    deadline = time.perf_counter() + args.budget_s
    for step in chosen:
        print(f"== {step.name}: {' '.join(step.command)}", flush=True)
        report["steps"][step.name] = run_step(step, work, deadline - time.perf_counter())
        print(f"   {report['steps'][step.name]['status']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    part = f"_part{args.part}" if args.part else ""
    path = Path(args.out) / f"gpu_suite_{device}{part}{'_smoke' if args.smoke else ''}.json"
    path.write_text(json.dumps(report, indent=2))
    if args.smoke:
        print("SMOKE RUN: not a GPU figure")
    print(table(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
