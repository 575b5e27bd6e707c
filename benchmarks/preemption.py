"""Preemption by recompute on long sequences, simulated on the engine's own scheduler and block manager (no model):
16 requests of 64 prompt tokens, 4 of them generating 2,048 tokens and 12 of them 256-512, on KV pools of 140-400
blocks of 16 tokens (one long sequence alone needs 132). Per pool: the decode and prefill steps, the preemptions, the
tokens re-prefilled after a preemption and the most re-prefills of one sequence, for the scheduler as it is and for
a growth reserve on admission (a waiting sequence is admitted only if the given fraction of the pool stays free while
others run), the policy this benchmark weighs. A step is the engine's unit of time when decode is bound by reading the
weights; a re-prefilled token costs a small fraction of one.

    python benchmarks/preemption.py [--seeds 3] [--blocks 140 200 300 400] [--reserve 0 0.1 0.2 0.3]

Writes ``benchmarks/results/preemption_cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import random

from gpu_common import environment, write_result

from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.scheduler import Scheduler
from spmd_rlhf.engine.sequence import SamplingParams, Sequence

BLOCK_SIZE = 16


class ReservingBlocks(BlockManager):
    """A block manager that admits a sequence only if ``reserve`` blocks stay free after it while others run."""

    def __init__(self, num_blocks: int, block_size: int, *, reserve: int) -> None:
        super().__init__(num_blocks, block_size)
        self.reserve, self.scheduler = reserve, None

    def try_allocate(self, seq: Sequence) -> bool:
        needed = -(-len(seq) // self.block_size)
        if self.scheduler.running and self.num_free_blocks - needed < self.reserve:
            return False
        return super().try_allocate(seq)


def simulate(num_blocks: int, reserve_fraction: float, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    blocks = ReservingBlocks(num_blocks, BLOCK_SIZE, reserve=int(reserve_fraction * num_blocks))
    scheduler = Scheduler(blocks, max_num_seqs=16, max_num_batched_tokens=4096)
    blocks.scheduler = scheduler
    lengths = [2048] * 4 + [rng.randint(256, 512) for _ in range(12)]
    rng.shuffle(lengths)
    for index, new_tokens in enumerate(lengths):
        prompt = [1000 + index * 100 + position for position in range(64)]
        scheduler.add(Sequence(index, prompt, SamplingParams(max_new_tokens=new_tokens), eos_token_id=None))
    steps = recomputed = 0
    prefills: dict[int, int] = {}
    while scheduler.has_work():
        batch, prefill = scheduler.schedule()
        steps += 1
        if prefill:
            for seq in batch:
                if seq.num_generated:
                    recomputed += len(seq)
                    prefills[seq.seq_id] = prefills.get(seq.seq_id, 0) + 1
            batch = [batch[row] for row in scheduler.end_prefill(batch)]
        scheduler.finish_step(batch, [7] * len(batch), [0.0] * len(batch), [0.0] * len(batch))
    return {
        "steps": steps,
        "preemptions": scheduler.num_preemptions,
        "recomputed_tokens": recomputed,
        "most_reprefills": max(prefills.values(), default=0),
        "generated_tokens": sum(lengths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--blocks", type=int, nargs="+", default=[140, 200, 300, 400])
    parser.add_argument("--reserve", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    rows = []
    print("| blocks | reserve | steps | preemptions | re-prefilled tokens | / generated | most re-prefills |")
    print("|" + " --- |" * 7)
    for num_blocks in args.blocks:
        for reserve in args.reserve:
            runs = [simulate(num_blocks, reserve, seed) for seed in range(args.seeds)]
            row = {key: sum(run[key] for run in runs) for key in runs[0] if key != "most_reprefills"}
            row = {"blocks": num_blocks, "reserve": reserve, **row}
            row["most_reprefills"] = max(run["most_reprefills"] for run in runs)
            rows.append(row)
            print(
                f"| {num_blocks} | {reserve:g} | {row['steps']} | {row['preemptions']} | {row['recomputed_tokens']} "
                f"| {row['recomputed_tokens'] / row['generated_tokens']:.2f} | {row['most_reprefills']} |"
            )
    result = {"benchmark": "preemption", "seeds": args.seeds, "block_size": BLOCK_SIZE, "rows": rows}
    write_result(args.out, "preemption_cpu", {**result, "environment": environment("cpu")})


if __name__ == "__main__":
    main()
