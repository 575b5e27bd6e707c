"""The HybridEngine's kept generation model (``rollout.keep_engine``): every reshard after the first writes the new
training weights into the same model and the same storage (what CUDA graphs captured on it read), and the values
equal a fresh generation model's, its merged projections computing the trained model's outputs. One rank of a gloo
job, FSDP over its one-rank mesh with one unit per layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from spmd_rlhf.hybrid import GenerationLayout, HybridEngine
from spmd_rlhf.models import DecoderLM
from spmd_rlhf.models.args import decoder_args
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.runtime import ParallelDims

ARGS = decoder_args(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def _hybrid(model: DecoderLM, *, keep: bool) -> HybridEngine:
    return HybridEngine(
        model,
        layout=GenerationLayout(ParallelDims(), (0,), tp=1),
        rank=0,
        groups={},
        pp_group=None,
        stage_ranks=[0],
        device=torch.device("cpu"),
        attention_backend="auto",
        keep_generation=keep,
    )


def test_a_kept_generation_model_is_rewritten_in_place_and_equals_a_fresh_one():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        training = DecoderLM(ARGS, head="lm")
        training.reset_buffers()
        parallelize(training, tp_mesh=None, dp_mesh=init_device_mesh("cpu", (1,)), min_unit_bytes=0)
        hybrid = _hybrid(training, keep=True)
        first = hybrid.generation_model(torch.float32)
        addresses = {name: param.data_ptr() for name, param in first.named_parameters()}
        with torch.no_grad():  # a training step
            for param in training.parameters():
                param.mul_(1.5).add_(0.01)
        second = hybrid.generation_model(torch.float32)
        assert second is first
        assert {name: param.data_ptr() for name, param in second.named_parameters()} == addresses
        fresh = _hybrid(training, keep=False).generation_model(torch.float32)
        assert fresh is not second
        trained = {name: param.full_tensor() for name, param in training.named_parameters()}
        for name, param in second.named_parameters():
            assert param.equal(fresh.get_parameter(name)) and param.equal(trained[name]), name
        # The generation copy runs merged q/k/v and gate/up matmuls, whose weights the reshard wrote through the
        # layers' own parameters (views of them): it computes what the trained model does.
        layers = second.model.layers.values()
        assert all(layer.self_attn.merged is not None and layer.mlp.merged is not None for layer in layers)
        tokens = torch.randint(ARGS.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(second(tokens), training(tokens), atol=1e-6, rtol=1e-6)
        # Another dtype cannot be written in place: a new model replaces the kept one.
        assert hybrid.generation_model(torch.bfloat16) is not second
    finally:
        if started:
            dist.destroy_process_group()
