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


def _skinny_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.spmd_rlhf.skinny_linear(x, self.weight, self.bias, self.skinny_backend)


def _skinny_matmul(self, x: torch.Tensor) -> torch.Tensor:
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
        swapped = 0
        for module in layer.modules():
            if isinstance(module, MergeableProjections) and module.merged is not None:
                module.merged.skinny_backend = backend
                module.merged.matmul = types.MethodType(_skinny_matmul, module.merged)
                swapped += 1
            elif isinstance(module, nn.Linear) and not _merged_into_parent(layer, module):
                module.skinny_backend = backend
                module.forward = types.MethodType(_skinny_forward, module)
                swapped += 1
        per_block = swapped if index == 0 else min(per_block, swapped)
    return per_block


def _merged_into_parent(layer: nn.Module, linear: nn.Linear) -> bool:
    """Whether ``linear`` is one of a merged ``MergeableProjections``' layers (run through its merged matmul)."""
    return any(
        isinstance(module, MergeableProjections)
        and module.merged is not None
        and any(child is linear for child in module.merged.linears)
        for module in layer.modules()
    )
