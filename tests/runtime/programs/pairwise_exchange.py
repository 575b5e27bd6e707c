"""Two gloo ranks swap their stored shards at once (each sends its rows to the other and receives the other's) with
``run_exchanges``, op by op and as one ``batch_isend_irecv`` group per round; both must deliver the other rank's
rows, tensor and non-tensor fields alike. Exits non-zero on a mismatch; prints ``ok rank N grouped=G`` per path.

    torchrun --nproc-per-node 2 tests/runtime/programs/pairwise_exchange.py
"""

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import end_process
from spmd_rlhf.runtime.transfer import Schema, ShardInfo, plan_exchanges, run_exchanges

ROWS = 3


def shard(rank: int) -> Batch:
    """Rank ``rank``'s rows: distinct values per rank so that a swapped or dropped piece shows."""
    rows = torch.arange(ROWS) + 100 * rank
    return Batch(
        {"ids": rows[:, None].repeat(1, 4), "scores": rows.double()},
        {"text": [f"rank{rank}-row{row}" for row in range(ROWS)]},
    )


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batched_calls = []
    batch_isend_irecv = dist.batch_isend_irecv

    def counting(ops):
        batched_calls.append(len(ops))
        return batch_isend_irecv(ops)

    dist.batch_isend_irecv = counting
    store = {5: shard(rank)}
    schema = Schema.of(store[5])
    for transfer_id, grouped in enumerate((False, True)):
        # Consumer DP rank 0 sits on rank 1 and the other way round: both ranks send and receive in the same round.
        plan = plan_exchanges(
            batch_id=5,
            shards=[ShardInfo(0, ROWS), ShardInfo(1, ROWS)],
            schema=schema,
            consumers=[[1], [0]],
            transfer_id=transfer_id,
        )
        mine = plan[rank]
        assert mine.sends and mine.pieces and mine.pieces[0].source == 1 - rank
        calls_before = len(batched_calls)
        (received,) = run_exchanges([mine], rank=rank, store=store, device=torch.device("cpu"), grouped=grouped)
        expected = shard(1 - rank)
        torch.testing.assert_close(received["ids"], expected["ids"], rtol=0, atol=0)
        torch.testing.assert_close(received["scores"], expected["scores"], rtol=0, atol=0)
        assert received["text"] == expected["text"], received["text"]
        # Two rounds (lengths of the pickled fields, then the payload), each one group when grouped.
        assert len(batched_calls) - calls_before == (2 if grouped else 0), batched_calls
        print(f"ok rank {rank} grouped={grouped}", flush=True)
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
