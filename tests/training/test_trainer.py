"""``Trainer.update`` reads nothing back from the device inside its micro-batch loop: counted with ``DispatchCounts``
around the real ``ActorWorker.update_actor`` on one CPU rank (``benchmarks/host_overhead.py``'s harness), an update
makes as many scalar reads at 8 micro-batches as at 2."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from spmd_rlhf.tiny.model import make_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from host_overhead import count_update  # noqa: E402

ROWS = 8


def test_scalar_reads_per_update_do_not_grow_with_the_micro_batch_count(tmp_path):
    model_dir = make_tiny(family="qwen2", out_dir=str(tmp_path / "model"), hidden_size=32, vocab_size=300)
    try:  # a one-rank gloo job in this process, started by the first actor
        counts = {
            micro_batches: count_update(model_dir, rows=ROWS, length=12, micro_batch=ROWS // micro_batches)
            for micro_batches in (2, 8)
        }
    finally:
        dist.destroy_process_group()
    assert counts[2].scalar_reads == counts[8].scalar_reads, (
        f"2 micro-batches: {dict(counts[2].scalar_read_sites)}; 8 micro-batches: {dict(counts[8].scalar_read_sites)}"
    )
