"""The device mapper at scale, simulated (no GPU needed): how long Algorithm 1 takes as clusters grow (the paper's
Figure 16), and which placement wins as the cluster and the critic/reward models grow (its placement study).

    python benchmarks/mapping_search.py [--profile h100] [--gpus 8 16 32 64 128 256 512 1024]

PPO with actor, critic, reference and reward model; ``--prompts`` prompts (default 1024) of 1024 tokens, 1024 new
tokens, micro-batch 8, mini-batch 256, 8 GPUs per node. Runtime table: every role the same size. Placement table: a 7B
actor and reference with critic and reward of the given size; each cell is the winning placement and how much faster it
is than colocating everything (1.00x: colocate wins). Writes
``benchmarks/results/mapping_search_<profile>_<prompts>.json`` and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from spmd_rlhf.mapping import BUILTIN_PROFILES, NAMED_SHAPES, Batch, Cluster, Planner, dataflow, load_profile

ROOT = Path(__file__).resolve().parents[1]


def plan(actor: str, scorer: str, gpus: int, profile, batch: Batch) -> dict | None:
    roles = dataflow(
        "ppo",
        actor=NAMED_SHAPES[actor],
        critic=NAMED_SHAPES[scorer],
        reference=NAMED_SHAPES[actor],
        reward=NAMED_SHAPES[scorer],
    )
    planner = Planner(roles, Cluster(gpus, 8, profile), batch)
    try:
        result = planner.plan(runners_up=0)
    except ValueError:
        return None  # does not fit
    colocated = planner.evaluate((tuple(role.name for role in roles),), (gpus,))
    return {
        "best": result.best.describe(),
        "best_s": result.best.seconds,
        "colocate_s": colocated.seconds if colocated else None,
        "mappings": result.mappings_evaluated,
        "search_s": result.search_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="h100")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--sizes", nargs="+", default=["7b", "13b", "34b", "70b"])
    parser.add_argument(
        "--prompts", type=int, default=1024, help="prompts per step (the paper's 1024; fewer: smaller per-GPU work)"
    )
    args = parser.parse_args()
    profile = load_profile(args.profile) if args.profile not in BUILTIN_PROFILES else BUILTIN_PROFILES[args.profile]

    batch = Batch(
        prompts=args.prompts, prompt_length=1024, response_length=1024, micro_batch_size=8, mini_batch_size=256
    )
    runtime = {size: {gpus: plan(size, size, gpus, profile, batch) for gpus in args.gpus} for size in args.sizes}
    placement = {size: {gpus: plan("7b", size, gpus, profile, batch) for gpus in args.gpus} for size in args.sizes}

    header = "| roles | " + " | ".join(f"{gpus} GPUs" for gpus in args.gpus) + " |"
    rule = "| --- |" + " --- |" * len(args.gpus)
    print("Search time (s) and mappings evaluated, every role the same size:\n")
    print(header + "\n" + rule)
    for size, row in runtime.items():
        cells = [f"{cell['search_s']:.2f} ({cell['mappings']})" if cell else "does not fit" for cell in row.values()]
        print(f"| {size} | " + " | ".join(cells) + " |")
    print("\nWinning placement (speed-up over colocating everything), 7B actor + reference:\n")
    print(header.replace("roles", "critic, reward") + "\n" + rule)
    for size, row in placement.items():
        cells = []
        for cell in row.values():
            if cell is None:
                cells.append("does not fit")
            elif cell["colocate_s"] is None:
                cells.append(f"{cell['best']} (colocate does not fit)")
            else:
                cells.append(f"{cell['best']} ({cell['colocate_s'] / cell['best_s']:.2f}x)")
        print(f"| {size} | " + " | ".join(cells) + " |")
    out = ROOT / "benchmarks" / "results" / f"mapping_search_{profile.name}_{args.prompts}.json"
    out.write_text(
        json.dumps(
            {
                "profile": profile.name,
                "batch": batch.__dict__,
                "runtime": runtime,
                "placement": placement,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "command": " ".join(["python", *sys.argv]),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
