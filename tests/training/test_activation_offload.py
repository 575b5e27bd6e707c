"""``model.activation_offload`` (``training.activation_offload.ActivationOffload``): saved activations go to host
memory and come back for the backward with the same gradients; parameters and small tensors stay; an actor's update
runs its training forwards under it. On CPU the hooks are pointed at the CPU (``source="cpu"``): what a GPU offloads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.training import sharded_model
from spmd_rlhf.training.activation_offload import ActivationOffload, _is_parameter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from gpu_update import synthetic_rollout  # noqa: E402
from host_overhead import one_rank_actor  # noqa: E402
from test_parallelize import tiny_args  # noqa: E402


def test_offloaded_activations_give_the_same_gradients_and_leave_parameters_alone():
    torch.manual_seed(0)
    plain = DecoderLM(tiny_args(), head="lm")
    plain.reset_buffers()
    ids = torch.randint(0, 64, (2, 7))
    plain(ids).float().logsumexp(-1).sum().backward()
    expected = [param.grad.clone() for param in plain.parameters()]
    for min_bytes, moved in ((1, True), (1 << 30, False)):
        plain.zero_grad()
        with ActivationOffload(source="cpu", min_bytes=min_bytes) as offload:
            loss = plain(ids).float().logsumexp(-1).sum()
        loss.backward()
        assert (offload.offloaded > 0) == moved and (offload.offloaded_bytes > 0) == moved
        for got, want in zip((param.grad for param in plain.parameters()), expected):
            torch.testing.assert_close(got, want)
    weight = plain.model.layers["0"].self_attn.q_proj.weight
    assert _is_parameter(weight) and _is_parameter(weight.t()) and not _is_parameter(weight.detach() * 2)


def test_saved_tensors_come_back_with_their_strides_and_gapped_views_stay():
    """Inductor's backward checks the strides of what it saved: a permuted activation must not come back contiguous
    (session 38's H100 run failed there with compiled blocks). A slice with gaps is not moved."""
    weight = torch.randn(4, 6, 5, requires_grad=True)
    with ActivationOffload(source="cpu", min_bytes=1) as offload:
        permuted = (weight * 2).permute(2, 0, 1)  # dense, not contiguous
        out = permuted.sin()  # sin saves its input
        gapped = (weight * 3)[:, ::2]
        gapped_out = gapped.cos()
    back = out.grad_fn._saved_self
    assert back.stride() == permuted.stride() and torch.equal(back, permuted)
    assert offload.offloaded == 1  # the permuted tensor; the gapped slice stayed
    assert gapped_out.grad_fn._saved_self.data_ptr() == gapped.data_ptr()
    (out.sum() + gapped_out.sum()).backward()
    assert weight.grad is not None


def test_an_actor_update_runs_its_training_forwards_offloaded(tmp_path, monkeypatch):
    """The key reaches the update's forwards (on CPU only when forced: a GPU feature), and the update's loss equals
    one without it."""
    offloads = []

    class Recorded(ActivationOffload):
        def __init__(self) -> None:
            super().__init__(source="cpu", min_bytes=1)
            offloads.append(self)

    monkeypatch.setattr(sharded_model, "ActivationOffload", Recorded)
    model_dir = make_tiny(family="qwen2", out_dir=str(tmp_path / "model"), hidden_size=32, vocab_size=300)
    losses = {}
    try:
        for offload in (False, True):
            actor = one_rank_actor(
                model_dir, rows=8, length=12, micro_batch=4, overrides=(f"model.activation_offload={offload}",)
            )
            assert not actor.model.offloads_activations  # off the GPU the key does nothing
            actor.model.offloads_activations = offload
            batch = synthetic_rollout(8, 12, 300, seed=0)
            metrics = actor.update_actor(batch)
            losses[offload] = (metrics["actor/loss"], metrics["actor/grad_norm"])
    finally:
        dist.destroy_process_group()
    assert len(offloads) == 2 and all(offload.offloaded > 0 for offload in offloads)  # one per micro-batch
    assert losses[True] == losses[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_activations_offloaded_to_pinned_memory_give_the_same_gradients():
    torch.manual_seed(0)
    model = DecoderLM(tiny_args(), head="lm").cuda()
    model.reset_buffers()
    ids = torch.randint(0, 64, (2, 7), device="cuda")
    model(ids).float().logsumexp(-1).sum().backward()
    expected = [param.grad.clone() for param in model.parameters()]
    model.zero_grad()
    with ActivationOffload(min_bytes=1) as offload:
        loss = model(ids).float().logsumexp(-1).sum()
    loss.backward()
    assert offload.offloaded > 0
    for got, want in zip((param.grad for param in model.parameters()), expected):
        torch.testing.assert_close(got, want)
