"""``Trainer.update`` reads nothing back from the device inside its micro-batch loop: counted with ``DispatchCounts``
around the real ``ActorWorker.update_actor`` on one CPU rank (``benchmarks/host_overhead.py``'s harness), an update
makes as many scalar reads at 8 micro-batches as at 2, and at dp = 1 as many FSDP copies. ``clip_gradients``
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

from gpu_update import synthetic_rollout  # noqa: E402
from host_overhead import count_update, one_rank_actor  # noqa: E402

from spmd_rlhf.metrics.dispatch_counts import DispatchCounts  # noqa: E402

ROWS = 8


def test_an_update_reads_and_copies_as_much_at_8_micro_batches_as_at_2(tmp_path):
    model_dir = make_tiny(family="qwen2", out_dir=str(tmp_path / "model"), hidden_size=32, vocab_size=300)
    per_micro_batch = ("actor.unsharded_accumulation_mb=0",)  # FSDP's default: gather, reshard, sync each time
    try:  # a one-rank gloo job in this process, started by the first actor
        counts = {
            (micro_batches, overrides): count_update(
                model_dir, rows=ROWS, length=12, micro_batch=ROWS // micro_batches, overrides=overrides
            )
            for micro_batches in (2, 8)
            for overrides in ((), per_micro_batch)
        }
    finally:
        dist.destroy_process_group()
    few, many = counts[2, ()], counts[8, ()]
    assert few.scalar_reads == many.scalar_reads, (
        f"2 micro-batches: {dict(few.scalar_read_sites)}; 8 micro-batches: {dict(many.scalar_read_sites)}"
    )
    # At dp = 1 a mini-batch gathers each unit once and reduce-scatters its gradient once (FSDP's chunk_cat copy-in),
    # whatever the micro-batch count: no FSDP copy per micro-batch.
    assert few.fsdp_copies == many.fsdp_copies and few.fsdp_copies["fsdp.chunk_cat"] > 0, (
        dict(few.fsdp_copies),
        dict(many.fsdp_copies),
    )
    # The same count with gathers and reduce-scatters in every micro-batch grows with them (the count can fail).
    copies = {
        micro_batches: sum(counts[micro_batches, per_micro_batch].fsdp_copies.values()) for micro_batches in (2, 8)
    }
    assert copies[8] > copies[2] > sum(few.fsdp_copies.values()), copies


def test_a_forward_call_gathers_once_whatever_its_micro_batch_count(tmp_path):
    """Old log-probs over 2 and 8 forward micro-batches at dp = 1: FSDP copies as many at 8 as at 2 with the units kept
    gathered through the call (``<role>.forward_gather_mb``), more at 8 with FSDP's per-micro-batch gathers, and the
    log-probs equal either way."""
    model_dir = make_tiny(family="qwen2", out_dir=str(tmp_path / "model"), hidden_size=32, vocab_size=300)
    counts, log_probs = {}, {}
    try:
        for micro_batches in (2, 8):
            for gathered in ("null", "0"):
                actor = one_rank_actor(
                    model_dir,
                    rows=ROWS,
                    length=12,
                    micro_batch=ROWS // micro_batches,
                    overrides=("actor.fsdp_unit_mb=0", f"actor.forward_gather_mb={gathered}"),
                )
                assert actor.model.gather_forward == (gathered == "null")
                batch = synthetic_rollout(ROWS, 12, 300, seed=0)
                actor.compute_log_probs(batch)
                with DispatchCounts() as counted:
                    log_probs[micro_batches, gathered] = actor.compute_log_probs(batch)["old_log_probs"]
                counts[micro_batches, gathered] = sum(counted.fsdp_copies.values())
    finally:
        dist.destroy_process_group()
    assert counts[2, "null"] == counts[8, "null"] > 0, counts
    assert counts[8, "0"] > counts[2, "0"] > counts[2, "null"], counts
    for key, value in log_probs.items():
        torch.testing.assert_close(value, log_probs[2, "0"], msg=str(key))


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
