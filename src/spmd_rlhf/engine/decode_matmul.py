"""``rollout.decode_matmul``: which kernels run the generation copy's projections at a few rows.

``use_skinny_linear`` points every decoder block's projections (the merged q/k/v and gate/up, o and down; not the
LM head, which cuBLAS already runs near the copy bandwidth, nor MoE experts) at ``torch.ops.spmd_rlhf.skinny_linear``,
which takes 1 to ``MAX_ROWS`` rows through ``spmd_rlhf.kernels.skinny_linear``'s Triton kernels and anything else
through ``F.linear``: decode steps at small batches use it, prefill and large batches do not. In a dense block with
merged projections (the generation copy's) it also moves the elementwise work between the matmuls into them: at
most ``MAX_ROWS`` rows, the block runs as

    h, qkv = skinny_residual_norm_linear(x, pending, input norm, q/k/v)   # the previous block's residual add too
    (attention)
    h, gate_up = skinny_residual_norm_linear(h, o_proj(out), post-attention norm, gate/up)
    pending = skinny_silu_mul_linear(gate_up, down)

four kernels (and down's split sum) where the compiled block ran seven; more rows take the block's own pieces. The
operators are opaque to TorchDynamo, so compiled blocks (``rollout.compile``) call them between what is left to fuse,
and decode graphs capture them. A TP replica on local shards (``models.local_tensor_parallel.run_locally``) takes
them too, on its shards: the merged matmuls hold local rows already, o and down (row-parallel) compute this rank's
partial product through the operator and then sum it over the TP group (``summed_over_ranks``).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from spmd_rlhf.kernels.skinny_linear import DEFAULT_CONFIG, MAX_ROWS, SkinnyConfig
from spmd_rlhf.kernels.triton_support import use_triton
from spmd_rlhf.models.decoder import DecoderLayer, DecoderLM
from spmd_rlhf.models.local_tensor_parallel import local_parameter, summed_over_ranks
from spmd_rlhf.models.merged_linear import MergeableProjections
from spmd_rlhf.models.moe import SwiGLU

DECODE_MATMULS = ("torch", "triton")


def _skinny_linear(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward, or a merged one's matmul, through the operator."""
    return torch.ops.spmd_rlhf.skinny_linear(x, self.weight, self.bias, *self.skinny_kernels)


def _takes(x: torch.Tensor) -> bool:
    """Whether the fused pieces run ``x`` (``[batch, seq, hidden]``): at most ``MAX_ROWS`` tokens."""
    return x.shape[0] * x.shape[1] <= MAX_ROWS


def _attention_inputs(self: DecoderLayer, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DecoderLayer.attention_inputs``: the input norm inside the q/k/v matmul."""
    if not _takes(x):
        return DecoderLayer.attention_inputs(self, x, rope)
    attention, norm = self.self_attn, self.input_layernorm
    qkv = torch.ops.spmd_rlhf.skinny_norm_linear(
        x, norm.weight, norm.eps, attention.merged.weight, attention.merged.bias, *self.skinny_kernels
    )
    return attention.split_merged_queries_keys_values(qkv, rope)


def _residual_attention_inputs(
    self: DecoderLayer, x: torch.Tensor, pending: torch.Tensor, rope
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DecoderLayer.residual_attention_inputs``: the residual add and the input norm inside the q/k/v matmul."""
    if not _takes(x):
        return DecoderLayer.residual_attention_inputs(self, x, pending, rope)
    attention, norm = self.self_attn, self.input_layernorm
    x, qkv = torch.ops.spmd_rlhf.skinny_residual_norm_linear(
        x, pending, norm.weight, norm.eps, attention.merged.weight, attention.merged.bias, *self.skinny_kernels
    )
    return (x, *attention.split_merged_queries_keys_values(qkv, rope))


def _attention_outputs_apart(
    self: DecoderLayer, x: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.attention_outputs_apart``: the residual add and the post-attention norm inside the gate/up
    matmul, the activation inside the down projection's."""
    if not _takes(x):
        return DecoderLayer.attention_outputs_apart(self, x, out)
    mlp, norm = self.mlp, self.post_attention_layernorm
    x, gate_up = torch.ops.spmd_rlhf.skinny_residual_norm_linear(
        x, self.self_attn.output(out), norm.weight, norm.eps, mlp.merged.weight, mlp.merged.bias, *self.skinny_kernels
    )
    down = mlp.down_proj
    if _on_local_shards(down):  # row-parallel: this rank's share of the product, then summed over the TP group
        partial = torch.ops.spmd_rlhf.skinny_silu_mul_linear(
            gate_up, local_parameter(down, "weight"), None, *self.skinny_kernels
        )
        return x, summed_over_ranks(down, partial)
    return x, torch.ops.spmd_rlhf.skinny_silu_mul_linear(gate_up, down.weight, down.bias, *self.skinny_kernels)


def _on_local_shards(linear: nn.Module) -> bool:
    """Whether ``linear`` computes on its local shards (``models.local_tensor_parallel.run_locally``)."""
    return getattr(linear, "local_shards", None) is not None


def _fusable(layer: DecoderLayer) -> bool:
    """A dense block whose q/k/v (without QK norms) and gate/up are merged: the fused pieces' shape."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        attention.merged is not None
        and not hasattr(attention, "q_norm")
        and isinstance(mlp, SwiGLU)
        and mlp.merged is not None
    )


def skinny_linear_unsupported(model: DecoderLM, *, backend: str = "auto") -> str | None:
    """Why ``use_skinny_linear`` cannot serve ``model`` with ``backend`` (a sentence), or None when it can."""
    weight = model.model.embed_tokens.weight
    if isinstance(weight, DTensor) and not model.local_tensor_parallel:
        return (
            "the model's tensor-parallel layers dispatch through DTensor; the kernels take a TP replica on local "
            "shards (models.local_tensor_parallel.run_locally)"
        )
    if not use_triton(weight.device, backend):
        return f"the Triton kernels need CUDA tensors and the triton package (the model is on {weight.device})"
    return None


def use_skinny_linear(
    model: DecoderLM, *, backend: str = "auto", config: SkinnyConfig = DEFAULT_CONFIG
) -> tuple[int, int]:
    """Point ``model``'s decoder projections at the skinny-linear operators (in place, for good: the engine's model
    is a generation copy), and the pieces of its fusable blocks at the fused ones; returns ``(matmuls per block
    through the operator, blocks fused)``. ``backend``: the kernels' (``auto``; tests under Triton's interpreter pass
    ``triton``); ``config``: their tiling. Call before ``compile_around_attention``, which traces the forwards."""
    kernels = (backend, config.as_tiling())  # every operator's last two arguments
    per_block, fused = 0, 0
    for index, layer in enumerate(model.model.layers.values()):
        merged = [m.merged for m in layer.modules() if isinstance(m, MergeableProjections) and m.merged is not None]
        inside_merged = {id(linear) for matmul in merged for linear in matmul.linears}
        for matmul in merged:
            matmul.skinny_kernels, matmul.matmul = kernels, types.MethodType(_skinny_linear, matmul)
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear) and id(m) not in inside_merged]
        for linear in linears:
            linear.skinny_kernels = kernels
            if not _on_local_shards(linear):  # a TP layer's own local forward takes the operator (skinny_kernels)
                linear.forward = types.MethodType(_skinny_linear, linear)
        swapped = len(merged) + len(linears)
        per_block = swapped if index == 0 else min(per_block, swapped)
        if _fusable(layer):
            layer.skinny_kernels = kernels
            for name, piece in (
                ("attention_inputs", _attention_inputs),
                ("residual_attention_inputs", _residual_attention_inputs),
                ("attention_outputs_apart", _attention_outputs_apart),
            ):
                setattr(layer, name, types.MethodType(piece, layer))
            fused += 1
    return per_block, fused


def apply_decode_matmul(model: DecoderLM, setting: str, *, config: SkinnyConfig = DEFAULT_CONFIG) -> str | None:
    """``rollout.decode_matmul``'s ``setting`` applied to ``model`` (``triton``: ``use_skinny_linear`` with
    ``config``, where ``skinny_linear_unsupported`` allows; ``torch``: nothing). Returns why ``triton`` could not
    be applied (the caller logs it once), else None."""
    if setting not in DECODE_MATMULS:
        raise ValueError(f"decode_matmul={setting!r} is unknown; choose one of {', '.join(DECODE_MATMULS)}")
    if setting == "torch":
        return None
    why = skinny_linear_unsupported(model)
    if why is None:
        use_skinny_linear(model, config=config)
    return why
