"""The tensor-parallel split of a decoder layer's linear layers, as data: ``parallelize`` applies it, and LoRA
adapters (``models.lora``) split the same way, so both read it from here."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from spmd_rlhf.collectives import sum_gradient_over
from spmd_rlhf.models.decoder import RMSNorm, rms_norm

DECODER_LAYER_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}
"""The linear layers of every decoder layer and their TP split (LoRA adapters split the same way, ``models.lora``)."""

SHARED_EXPERT_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.mlp.shared_expert.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.shared_expert.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.shared_expert.down_proj": RowwiseParallel(),
}
"""A mixture-of-experts layer's shared expert (Qwen2-MoE), split as the dense MLP is. The router and the shared
expert's one-output gate stay whole on every TP rank; the routed experts split their intermediate width by hand
(``models.expert_parallel``)."""


class HeadNormParallel(ParallelStyle):
    """A norm over each attention head's features (Qwen3's ``q_norm`` / ``k_norm``) whose one weight every TP rank
    applies to its own heads: the weight stays whole on every rank, and its gradient, each rank's sum over its own
    heads, is summed over tp (Megatron's ``f`` on the weight), so every rank keeps the same weight."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, RMSNorm), module
        module.forward = functools.partial(_head_norm, module, device_mesh.get_group())
        return module


def _head_norm(module: RMSNorm, group: torch.distributed.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, sum_gradient_over(module.weight, group), module.eps)


HEAD_NORM_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.self_attn.q_norm": HeadNormParallel(),
    "model.layers.*.self_attn.k_norm": HeadNormParallel(),
}
"""The per-head query / key norms of a model with ``qk_norm``."""
