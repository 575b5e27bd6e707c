"""A GRPO run under repeated faults against the same run with none: does every fault cost only time?

    OMP_NUM_THREADS=1 python benchmarks/fault_soak.py                      # 200 steps, 2 ranks, 6 faults
    OMP_NUM_THREADS=1 python benchmarks/fault_soak.py --steps 40 --faults 3 --save-every 5
    OMP_NUM_THREADS=1 python benchmarks/fault_soak.py --rollout --ranks 3   # a rollout role, faults in weight syncs

Both runs are ``benchmarks/faulty_grpo.py`` (recipes/grpo.py on the tiny task) under
``torchrun --standalone --max-restarts K`` with ``trainer.resume=auto``. The faulted run's plan has one fault per
torchrun round, each on a random rank (the coordinator's too), of a kind drawn in turn from ``--kinds`` (SIGKILL,
SIGTERM, hang), striking at a random call of ``update_actor`` (mid-step) or ``save_checkpoint`` (mid-save). Reported:
faults that struck, torchrun restarts and steps redone (the run's own ``faults/*`` metrics), wall time against the
clean run, and whether the final parameters, the final sharded training state (optimizer, LR schedule, RNG) and every
training metric row equal the clean run's bit for bit. With ``--rollout`` the runs are asynchronous GRPO with a
rollout role on the last rank, the faults strike the actor's ranks, also in ``send_weights`` (mid weight sync).
Writes ``benchmarks/results/fault_soak.json`` (``fault_soak_rollout.json`` with ``--rollout``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "benchmarks" / "faulty_grpo.py"
RESULTS = ROOT / "benchmarks" / "results" / "fault_soak.json"
KINDS = ("SIGKILL", "SIGTERM", "hang")
NOT_TRAINING = ("time/", "throughput/", "coordinator/", "faults/", "perf/")
"""Metric prefixes that measure the run's speed or its faults, not its training."""


def fault_plan(
    *,
    faults: int,
    ranks: int,
    kinds: list[str],
    steps_per_round: int,
    save_every: int,
    seed: int,
    weight_sync: bool = False,
):
    """One fault per round 0 .. faults-1: a random rank of the first ``ranks`` (the actor's), kinds in turn, a random
    call of update_actor, of save_checkpoint or (``weight_sync``: a rollout role is on) of send_weights among the
    first ``steps_per_round`` steps of the round."""
    chooser = random.Random(seed)
    points = ["update_actor"] + (["save_checkpoint"] if save_every else []) + (["send_weights"] if weight_sync else [])
    plan = []
    for round_index in range(faults):
        at = chooser.choice(points)
        calls = max(1, steps_per_round // save_every) if at == "save_checkpoint" else steps_per_round
        plan.append(
            {
                "round": round_index,
                "rank": chooser.randrange(ranks),
                "at": at,
                "call": chooser.randint(1, calls),
                "kind": kinds[round_index % len(kinds)],
            }
        )
    return plan


def run_faulty_grpo(
    workdir: Path, output_dir: str, overrides: list[str], *, plan: list[dict], nproc: int, timeout_s: float
) -> subprocess.CompletedProcess:
    """``benchmarks/faulty_grpo.py`` under ``torchrun --standalone --max-restarts len(plan)`` in ``workdir``, writing
    ``workdir/<output_dir>``; the faults that struck go to ``<output_dir>.faults.jsonl``. Output in ``.stdout``."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={len(plan)}",
        str(PROGRAM),
        f"trainer.output_dir={output_dir}",
        "trainer.resume=auto",
        *overrides,
    ]
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SPMD_RLHF_FAULTS": json.dumps(plan),
        "SPMD_RLHF_FAULT_LOG": str(workdir / f"{output_dir}.faults.jsonl"),
    }
    return subprocess.run(
        command,
        cwd=workdir,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )


def struck_faults(workdir: Path, output_dir: str) -> list[dict]:
    log = workdir / f"{output_dir}.faults.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def training_rows(run_dir: Path) -> list[dict]:
    """Every row of ``metrics.jsonl`` without the speed and fault metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in row.items() if not key.startswith(NOT_TRAINING)} for row in rows]


def final_weights(run_dir: Path) -> dict:
    """The final checkpoint's Hugging Face copy of the actor's weights."""
    from safetensors.torch import load_file

    checkpoint = run_dir / (run_dir / "latest").read_text().strip()
    return load_file(str(checkpoint / "actor" / "model.safetensors"))


def final_training_state(run_dir: Path) -> dict[str, bytes]:
    """The final checkpoint's sharded actor state (weights, optimizer, LR schedule, each rank's RNG) as written: the
    bytes of each rank's DCP file."""
    checkpoint = run_dir / (run_dir / "latest").read_text().strip()
    return {path.name: path.read_bytes() for path in sorted((checkpoint / "actor_state").glob("*.distcp"))}


def same_weights(left: dict, right: dict) -> bool:
    import torch

    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run (default 200)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (2-4 on CPU)")
    parser.add_argument("--faults", type=int, default=6, help="faults injected, one per torchrun round")
    parser.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, drawn in turn")
    parser.add_argument("--save-every", type=int, default=10, help="trainer.save_every of both runs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault plan")
    parser.add_argument("--hang-timeout-s", type=float, default=20.0, help="trainer.collective_timeout_s: ends a hang")
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a new temporary directory)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit of each torchrun job")
    parser.add_argument(
        "--rollout",
        action="store_true",
        help="asynchronous GRPO: a rollout role on the last rank (algorithm.max_staleness=1), faults also during the "
        "actor's weight sync to it",
    )
    options = parser.parse_args()
    kinds = options.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds {unknown} unknown; choose from {', '.join(KINDS)}")
    workdir = Path(options.workdir or tempfile.mkdtemp(prefix="fault_soak_"))
    overrides = [
        f"trainer.total_steps={options.steps}",
        f"trainer.save_every={options.save_every}",
        "trainer.val_every=0",
        f"trainer.collective_timeout_s={options.hang_timeout_s}",
        f"trainer.timeout_s={3 * options.hang_timeout_s}",
    ]
    if options.rollout:  # placement=split puts the actor first, the rollout role (and the rule) on the last rank
        overrides += ["rollout.enabled=true", "rollout.n_ranks=1", "algorithm.max_staleness=1"]
    plan = fault_plan(
        faults=options.faults,
        ranks=options.ranks - 1 if options.rollout else options.ranks,
        weight_sync=options.rollout,
        kinds=kinds,
        steps_per_round=max(1, options.steps // (options.faults + 1)),
        save_every=options.save_every,
        seed=options.seed,
    )
    walls, outcomes = {}, {}
    for name, run_plan in (("clean", []), ("faulted", plan)):
        started = time.perf_counter()
        finished = run_faulty_grpo(
            workdir, name, overrides, plan=run_plan, nproc=options.ranks, timeout_s=options.timeout_s
        )
        walls[name] = time.perf_counter() - started
        (workdir / f"{name}.log").write_text(finished.stdout)
        outcomes[name] = finished.returncode
        if finished.returncode != 0:
            print(finished.stdout[-6000:], file=sys.stderr)
            raise SystemExit(f"the {name} run failed (exit {finished.returncode}); its output: {workdir}/{name}.log")
    clean, faulted = workdir / "clean", workdir / "faulted"
    last_row = json.loads((faulted / "metrics.jsonl").read_text().splitlines()[-1])
    struck = struck_faults(workdir, "faulted")
    result = {
        "steps": options.steps,
        "ranks": options.ranks,
        "rollout_role": options.rollout,
        "save_every": options.save_every,
        "plan": plan,
        "faults_struck": len(struck),
        "struck_by_kind": {kind: sum(fault["kind"] == kind for fault in struck) for kind in KINDS},
        "restarts": last_row["faults/restarts"],
        "steps_redone": last_row["faults/steps_redone"],
        "wall_s": {name: round(seconds, 1) for name, seconds in walls.items()},
        "wall_ratio": round(walls["faulted"] / walls["clean"], 2),
        "equal_parameters": same_weights(final_weights(clean), final_weights(faulted)),
        "equal_training_state": final_training_state(clean) == final_training_state(faulted),
        "equal_metric_rows": training_rows(clean) == training_rows(faulted),
        "workdir": str(workdir),
        "command": " ".join(["python benchmarks/fault_soak.py", *sys.argv[1:]]),
    }
    results = RESULTS.with_name("fault_soak_rollout.json") if options.rollout else RESULTS
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'run':<8} {'wall s':>7} {'faults struck':>14} {'restarts':>9} {'steps redone':>13}")
    print(f"{'clean':<8} {walls['clean']:>7.1f} {0:>14} {0:>9} {0:>13}")
    print(
        f"{'faulted':<8} {walls['faulted']:>7.1f} {len(struck):>14} {result['restarts']:>9} "
        f"{result['steps_redone']:>13}   ({result['wall_ratio']}x the clean run's wall time)"
    )
    print("struck: " + ", ".join(f"{fault['kind']} rank {fault['rank']} in {fault['at']}" for fault in struck))
    for key in ("equal_parameters", "equal_training_state", "equal_metric_rows"):
        print(f"{key}: {result[key]}")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
