"""``rollout.decode_matmul``: which kernel runs the generation copy's projections at a few rows.

``use_skinny_linear`` points every decoder block's projections (the merged q/k/v and gate/up, o and down; not the
LM head, which cuBLAS already runs near the copy bandwidth, nor MoE experts) at ``torch.ops.spmd_rlhf.skinny_linear``,
which takes 1 to ``MAX_ROWS`` rows through ``spmd_rlhf.kernels.skinny_linear``'s Triton kernels and anything else
through ``F.linear``: decode steps at small batches use it, prefill and large batches do not. The operator is opaque
to TorchDynamo, so compiled blocks (``rollout.compile``) call it between their fused kernels, and decode graphs
capture it.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from spmd_rlhf.kernels import skinny_linear as _registers_the_operator  # noqa: F401
from spmd_rlhf.kernels.triton_support import use_triton
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.merged_linear import MergeableProjections

DECODE_MATMULS = ("torch", "triton")


def _skinny_linear(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward, or a merged one's matmul, through the operator."""
    return torch.ops.spmd_rlhf.skinny_linear(x, self.weight, self.bias, self.skinny_backend)


def skinny_linear_unsupported(model: DecoderLM, *, backend: str = "auto") -> str | None:
    """Why ``use_skinny_linear`` cannot serve ``model`` with ``backend`` (a sentence), or None when it can."""
    weight = model.model.embed_tokens.weight
    if getattr(model, "local_tensor_parallel", False) or isinstance(weight, DTensor):
        return "the kernel runs on a tp=1 generation copy (its TP layers compute on local shards of their own)"
    if not use_triton(weight.device, backend):
        return f"the Triton kernels need CUDA tensors and the triton package (the model is on {weight.device})"
    return None


def use_skinny_linear(model: DecoderLM, *, backend: str = "auto") -> int:
    """Point ``model``'s decoder projections at the skinny-linear operator (in place, for good: the engine's model is
    a generation copy); returns how many matmuls per block did. ``backend``: the kernels' (``auto``; tests under
    Triton's interpreter pass ``triton``). Call before ``compile_around_attention``, which traces the forwards."""
    per_block = 0
    for index, layer in enumerate(model.model.layers.values()):
        merged = [m.merged for m in layer.modules() if isinstance(m, MergeableProjections) and m.merged is not None]
        inside_merged = {id(linear) for matmul in merged for linear in matmul.linears}
        for matmul in merged:
            matmul.skinny_backend, matmul.matmul = backend, types.MethodType(_skinny_linear, matmul)
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear) and id(m) not in inside_merged]
        for linear in linears:
            linear.skinny_backend, linear.forward = backend, types.MethodType(_skinny_linear, linear)
        swapped = len(merged) + len(linears)
        per_block = swapped if index == 0 else min(per_block, swapped)
    return per_block
