"""``models.parallelize`` on one process: activation checkpointing keeps names and changes no gradient."""

from __future__ import annotations

import torch

from spmd_rlhf.models import DecoderLM
from spmd_rlhf.models.args import DecoderArgs
from spmd_rlhf.models.parallelize import parallelize


def tiny_args() -> DecoderArgs:
    return DecoderArgs(
        family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
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
