"""``Trainer.update`` reads nothing back from the device inside its micro-batch loop: counted with ``DispatchCounts``
around the real ``ActorWorker.update_actor`` on one CPU rank (``benchmarks/host_overhead.py``'s harness), an update
makes as many scalar reads at 8 micro-batches as at 2, and at dp = 1 as many reduce-scatters. ``clip_gradients``
(fused norms) clips plain tensors as ``torch.nn.utils.clip_grad_norm_`` does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.training.trainer import clip_gradients

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
    # At dp = 1 the gradients stay unsharded across the micro-batches: one reduce-scatter (FSDP's chunk_cat copy-in)
    # per unit per mini-batch, whatever the micro-batch count.
    reduce_scatters = {micro_batches: counts[micro_batches].fsdp_copies["fsdp.chunk_cat"] for micro_batches in (2, 8)}
    assert reduce_scatters[2] == reduce_scatters[8] > 0, reduce_scatters


class _OneRank:
    """A process group of one rank, as far as ``clip_gradients`` looks at it."""

    def size(self) -> int:
        return 1


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_gradients_equals_torch_clip_grad_norm(max_norm):
    generator = torch.Generator().manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((3, 4), (5,), (2, 2, 2))]
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    gradients = [parameter.grad.clone() for parameter in parameters]
    norm = clip_gradients(
        gradients, max_norm, stage_groups=[_OneRank()], pipeline_group=None, device=torch.device("cpu")
    )
    expected = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for gradient, parameter in zip(gradients, parameters):
        torch.testing.assert_close(gradient, parameter.grad)
