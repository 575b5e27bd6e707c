"""``models.parallelize`` on one process: activation checkpointing keeps names and changes no gradient; FSDP's units
(an untied embedding and LM head each alone, a tied pair in the root; small layers grouped, trailing ones in the
root); under FSDP a tied embedding's sparse gradient sums into the head's to the plain model's gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torchrun_helpers import forked_ranks

from spmd_rlhf.models import DecoderLM
from spmd_rlhf.models import attention as attention_module
from spmd_rlhf.models.args import DecoderArgs, decoder_args
from spmd_rlhf.models.parallelize import fsdp_units, group_layers, parallelize


def tiny_args() -> DecoderArgs:
    return decoder_args(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )


def test_activation_checkpointing_keeps_names_and_gradients():
    torch.manual_seed(0)
    plain = DecoderLM(tiny_args(), head="lm")
    checkpointed = DecoderLM(tiny_args(), head="lm")
    checkpointed.load_state_dict(plain.state_dict())
    for model in (plain, checkpointed):
        model.reset_buffers()
    parallelize(checkpointed, tp_mesh=None, dp_mesh=None, activation_checkpointing=True)
    assert [name for name, _ in checkpointed.named_parameters()] == [name for name, _ in plain.named_parameters()]
    ids = torch.randint(0, 64, (2, 7))
    for model in (plain, checkpointed):
        model(ids).float().logsumexp(-1).sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


class Counter(TorchDispatchMode):
    """The ops run under it, by name (an operator's own ops inside it are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_keeps_a_long_rows_length_class_attention(monkeypatch):
    """A long packed row's attention per length class (``models.length_buckets``, one operator) is kept by selective
    checkpointing like SDPA: the backward runs the operator's backward once per layer, never its forward again."""
    monkeypatch.setattr(attention_module, "MASK_TOKEN_LIMIT", 0)
    torch.manual_seed(0)
    model = DecoderLM(tiny_args(), head="lm")
    parallelize(model, tp_mesh=None, dp_mesh=None, activation_checkpointing=True, checkpoint_policy="selective")
    lengths = [3, 5, 9]  # three length classes
    ids = torch.randint(0, 64, (1, sum(lengths)))
    cu_seqlens = torch.tensor([0, 3, 8, 17], dtype=torch.int32)
    loss = model(ids, cu_seqlens=cu_seqlens, max_seqlen=max(lengths)).float().logsumexp(-1).sum()
    with Counter() as counter:
        loss.backward()
    layers = tiny_args().num_layers
    assert counter.counts.get("length_bucketed_attention_backward") == layers
    assert "length_bucketed_attention" not in counter.counts


def test_selective_checkpointing_runs_no_matmul_again_and_keeps_the_gradients():
    """``model.checkpoint_policy=selective``: the backward of a checkpointed block reruns its elementwise work but no
    matmul (their outputs were kept), where full checkpointing reruns the whole forward; gradients equal
    no checkpointing in both."""
    torch.manual_seed(0)
    plain = DecoderLM(tiny_args(), head="lm")
    ids = torch.randint(0, 64, (2, 7))
    backward_counts, grads = {}, {}
    for policy in ("none", "full", "selective"):
        model = DecoderLM(tiny_args(), head="lm")
        model.load_state_dict(plain.state_dict())
        model.reset_buffers()
        if policy != "none":
            parallelize(model, tp_mesh=None, dp_mesh=None, activation_checkpointing=True, checkpoint_policy=policy)
        loss = model(ids).float().logsumexp(-1).sum()
        with Counter() as counter:
            loss.backward()
        backward_counts[policy] = counter.counts
        grads[policy] = [param.grad for param in model.parameters()]
    for policy in ("full", "selective"):
        for expected, got in zip(grads["none"], grads[policy]):
            torch.testing.assert_close(got, expected)
    layers = tiny_args().num_layers
    attention = "_scaled_dot_product_flash_attention_for_cpu"  # the forward's attention kernel (sdpa on CPU)
    matmuls = {policy: counts.get("mm", 0) + counts.get("addmm", 0) for policy, counts in backward_counts.items()}
    assert matmuls["full"] > matmuls["none"] and backward_counts["full"].get(attention) == layers  # all again
    assert matmuls["selective"] == matmuls["none"] and attention not in backward_counts["selective"]
    assert backward_counts["selective"].get("rsqrt", 0) >= backward_counts["none"].get("rsqrt", 0) + 2 * layers


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_blocks_compile_and_keep_the_gradients(policy, monkeypatch):
    """``model.compile`` with ``model.activation_checkpointing`` (each policy): the block compiles inside its checkpoint
    (a compiled module call whose forward is the checkpoint compiled no frame, an error under ``fullgraph``), and the
    gradients equal eager blocks without checkpointing."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from spmd_rlhf.models import parallelize as parallelize_module

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(parallelize_module, "COMPILE_BACKEND", counter)
    torch.manual_seed(0)
    plain = DecoderLM(tiny_args(), head="lm")
    compiled = DecoderLM(tiny_args(), head="lm")
    compiled.load_state_dict(plain.state_dict())
    for model in (plain, compiled):
        model.reset_buffers()
    parallelize(
        compiled,
        tp_mesh=None,
        dp_mesh=None,
        activation_checkpointing=True,
        checkpoint_policy=policy,
        compile_layers=True,
    )
    ids = torch.randint(0, 64, (2, 7))
    for model in (plain, compiled):
        model(ids).float().logsumexp(-1).sum().backward()
    assert counter.frame_count >= 1  # the blocks ran compiled
    for (name, a), (_, b) in zip(plain.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_fsdp_units_split_an_untied_vocabulary():
    with torch.device("meta"):
        untied = DecoderLM(tiny_args(), head="lm")
        tied = DecoderLM(dataclasses.replace(tiny_args(), tie_word_embeddings=True), head="lm")
        critic = DecoderLM(dataclasses.replace(tiny_args(), tie_word_embeddings=True), head="value")
    layers = list(untied.model.layers.values())
    assert fsdp_units(untied) == [*layers, untied.model.embed_tokens, untied.lm_head]
    # One parameter belongs to one FSDP unit: a tied pair stays in the root, which serves both ends of the forward.
    assert fsdp_units(tied) == list(tied.model.layers.values())
    # A value head's model has no LM head to share the embedding with.
    assert fsdp_units(critic) == [*critic.model.layers.values(), critic.model.embed_tokens]


def test_group_layers_reach_the_bound_and_leave_the_rest_to_the_root():
    assert group_layers([5, 5, 5], 0) == [[0], [1], [2]]
    assert group_layers([5, 5, 5, 5, 5], 10) == [[0, 1], [2, 3]]  # layer 4 joins the root
    assert group_layers([20, 5, 5, 20], 10) == [[0], [1, 2], [3]]
    assert group_layers([5, 5], 100) == []


def test_fsdp_units_group_small_layers():
    args = dataclasses.replace(tiny_args(), num_layers=3)
    with torch.device("meta"):
        untied = DecoderLM(args, head="lm")
    layers = list(untied.model.layers.values())
    layer_bytes = sum(param.numel() * 4 for param in layers[0].parameters())
    embedding_bytes = untied.model.embed_tokens.weight.numel() * 4
    assert embedding_bytes < layer_bytes
    # Runs of two layers; the third and the small vocabulary modules join the root.
    assert fsdp_units(untied, 2 * layer_bytes) == [layers[:2]]
    assert fsdp_units(untied, embedding_bytes) == [*layers, untied.model.embed_tokens, untied.lm_head]
    assert fsdp_units(untied, 10 * layer_bytes) == []


def _tied_gradients_under_fsdp(rank: int, port: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    torch.manual_seed(0)
    args = dataclasses.replace(tiny_args(), tie_word_embeddings=True)
    plain, sharded = DecoderLM(args, head="lm"), DecoderLM(args, head="lm")
    sharded.load_state_dict(plain.state_dict())
    for model in (plain, sharded):
        model.reset_buffers()
    parallelize(sharded, tp_mesh=None, dp_mesh=init_device_mesh("cpu", (1,)))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    for model in (plain, sharded):
        model(ids).float().logsumexp(-1).sum().backward()
    grads = {name: param.grad.full_tensor() for name, param in sharded.named_parameters()}
    results.update(
        sparse=sharded.model.embed_tokens.sparse and not plain.model.embed_tokens.sparse,
        equal=all(
            torch.allclose(grads[name], param.grad, rtol=1e-5, atol=1e-6) for name, param in plain.named_parameters()
        ),
        names=sorted(grads) == sorted(name for name, _ in plain.named_parameters()),
    )
    dist.destroy_process_group()


def test_a_tied_embedding_under_fsdp_takes_a_sparse_gradient_summed_into_the_heads():
    assert forked_ranks(_tied_gradients_under_fsdp, 1) == {"sparse": True, "equal": True, "names": True}


def test_a_model_built_on_a_device_has_its_rotary_frequencies():
    """The rotary frequencies are a non-persistent buffer: a model built straight on a device (not on the meta device
    and loaded) must compute them at construction, not leave ``torch.empty``'s contents."""
    from spmd_rlhf.models.rope import rope_inverse_frequencies

    args = tiny_args()
    expected = rope_inverse_frequencies(head_dim=args.head_dim, theta=args.rope_theta, scaling=None, device="cpu")
    for _ in range(3):
        torch.testing.assert_close(DecoderLM(args, head="lm").model.rotary.inv_freq, expected.float())
