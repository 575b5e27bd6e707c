"""Long sequences under context parallelism: ``python benchmarks/scale.py --seq-len 4096 16384 --cp 1 2`` runs this
program under ``torchrun --nproc-per-node CP`` once per ``--cp``, each time on freshly started ranks.

Each rank holds 2 rows of ``length`` real tokens (a quarter prompt, a synthetic GRPO rollout) and the actor (FSDP over
the ranks, ``actor.cp`` = the ranks, ``cp_attention=auto``) takes ``--repeats`` + 1 updates of one row per micro-batch:
at cp = 1 one rank runs a whole row per micro-batch, at cp = 2 two ranks run half of each of their 4 rows. Per rank
and update: the peak of the resident set over the update less the resident set just before it (the kernel's
high-water mark, reset before each update through ``/proc/self/clear_refs``; glibc returns every freed block of 64
KiB or more at once, as in ``scale.py``), and the seconds. The first update also allocates the gradients and Adam's
moments; later ones are the steady state. Writes one JSON line per length to ``--out``.

The floor of a steady update's rise on one rank: a token's activations as ``training.token_budget`` counts them
(``bytes_per_token``, checkpointing as configured, the logits at every token of the rank's chunk)
times the tokens of one micro-batch on the rank (``length / cp``), plus the float32 gradients of this rank's share of
the parameters (FSDP over the ranks; freed after the step, so part of the rise). Not counted: FSDP's gathered
parameters and unsharded gradients of the unit in flight at cp > 1 (dp = cp ranks), the exchanged rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_update import GROUP_SIZE, synthetic_rollout  # noqa: E402

from spmd_rlhf.config import load_config  # noqa: E402
from spmd_rlhf.models import read_decoder_args  # noqa: E402
from spmd_rlhf.runtime import ParallelDims, ResourcePool, all_to_all, launch  # noqa: E402
from spmd_rlhf.training.token_budget import bytes_per_token  # noqa: E402
from spmd_rlhf.workers import ActorWorker  # noqa: E402

ROWS_PER_RANK = 2


def _status_bytes(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


class MeasuredActor(ActorWorker):
    """The actor, with updates measured for time and for the resident set's rise on every rank."""

    @all_to_all
    def measure_updates(self, length: int, repeats: int) -> dict:
        batch = synthetic_rollout(ROWS_PER_RANK, length, self.model.module.args.vocab_size, seed=self.context.rank)
        rises, seconds = [], []
        for _ in range(repeats + 1):
            Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the resident set now
            before = _status_bytes("VmRSS:")
            start = time.perf_counter()
            metrics = self.update_actor(batch)
            seconds.append(time.perf_counter() - start)
            rises.append(_status_bytes("VmHWM:") - before)
        return {
            "rise_bytes": rises,
            "seconds": seconds,
            "padding_tokens": metrics.get("actor/cp_padding_tokens", 0),
            "parameters": sum(param.numel() for param in self.model.module.parameters()),
        }


def main(coordinator) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = coordinator.world_size
    rows = ROWS_PER_RANK * world
    config = load_config(
        None,
        [
            f"model.path={args.model_dir}",
            "model.dtype=float32",
            f"model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
            "algorithm.name=grpo",
            "algorithm.kl_penalty=loss",
            "algorithm.kl_estimator=k3",
            "critic.enabled=false",
            f"rollout.n={GROUP_SIZE}",
            f"rollout.max_new_tokens={max(args.lengths)}",
            f"data.max_prompt_length={max(args.lengths)}",
            f"data.batch_size={rows // GROUP_SIZE}",
            f"actor.mini_batch_size={rows}",
            "actor.micro_batch_size=1",
            "actor.max_tokens_per_micro_batch=null",
            f"actor.cp={world}",
            "actor.fsdp_unit_mb=0",
            "actor.lr=1e-6",
        ],
    )
    actor = coordinator.spawn(
        MeasuredActor, config, name="actor", pool=ResourcePool(range(world)), dims=ParallelDims(dp=world, cp=world)
    )
    model_args = read_decoder_args(args.model_dir)
    for length in args.lengths:
        per_rank = actor.measure_updates([length] * world, [args.repeats] * world).result()
        activations = bytes_per_token(
            model_args,
            tp=1,
            pp=1,
            dtype_bytes=4,
            train=True,
            activation_checkpointing=args.activation_checkpointing,
        ) * (length / world)
        gradients = 4 * per_rank[0]["parameters"] / world
        record = {
            "length": length,
            "cp": world,
            "activation_checkpointing": args.activation_checkpointing,
            "rise_bytes_per_rank": [rank["rise_bytes"] for rank in per_rank],
            "seconds_per_rank": [rank["seconds"] for rank in per_rank],
            "padding_tokens": [rank["padding_tokens"] for rank in per_rank],
            "floor_bytes": {"activations": activations, "gradients": gradients},
        }
        with open(args.out, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    launch(main)
