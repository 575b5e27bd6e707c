"""A rollout replica of 2 tensor-parallel ranks agrees on host work: ``OneReplica.on_replica_leader`` runs the
computation on the replica's first rank only and hands its result to both (a multi-turn environment's answers, which
may differ from call to call, must be the same on every rank of the engine that continues from them).

    torchrun --nproc-per-node 2 replica_leader.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from spmd_rlhf.runtime import end_process
from spmd_rlhf.workers.replicas import OneReplica


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls = []

    def answer() -> dict:
        calls.append(rank)
        return {"answer": f"from rank {rank}"}

    shared = OneReplica(dist.new_group([0, 1])).on_replica_leader(answer)
    alone = OneReplica().on_replica_leader(answer)
    (out / f"rank{rank}.json").write_text(json.dumps({"shared": shared, "alone": alone, "calls": calls}))
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
