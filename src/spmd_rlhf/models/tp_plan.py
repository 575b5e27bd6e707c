"""The tensor-parallel split of a decoder layer's linear layers, as data: ``parallelize`` applies it, and LoRA
adapters (``models.lora``) split the same way, so both read it from here.

The styles split the parameters as ``ColwiseParallel`` / ``RowwiseParallel`` do (DTensor parameters over the TP mesh:
what FSDP2, checkpoints, the reshard and the weight sync read), but their forwards compute on this rank's local
shards with Megatron's two autograd operators (``collectives``) instead of DTensor's input and output hooks:

- column-parallel (q, k, v, gate, up): ``f(x) W_local^T + b_local``, ``f`` summing the input's gradient over tp,
  once for all the layers that read one input (``SharedColumnInput`` on their ``MergeableProjections`` parent: one
  all-reduce of ``[tokens, hidden]`` in the backward for q/k/v and one for gate/up, where DTensor's hooks run one
  per layer, five per decoder layer);
- row-parallel (o, down): ``g(x_local W_local^T) + b``, ``g`` the forward's all-reduce;
- the vocabulary-parallel embedding: each rank looks up the ids in its rows (zeros elsewhere), then ``g``.

The same arithmetic and collectives as the DTensor hooks, without their dispatch (host work per call), and what
``torch.compile`` traces in a block: a block on DTensor hooks fails in AOTAutograd (torch 2.13: a RecursionError
with dynamic shapes), and an embedding output that is ``to_local``'s view loses its gradient through a compiled
block (its input comes back with none). Parameters are read through ``to_local()`` at every call, whose backward
hands each DTensor parameter its local gradient.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from spmd_rlhf.collectives import sum_gradient_over, sum_over
from spmd_rlhf.models.decoder import RMSNorm, rms_norm
from spmd_rlhf.models.merged_linear import MergeableProjections


def _local(module: nn.Module, name: str) -> torch.Tensor | None:
    param = getattr(module, name)
    return param.to_local() if isinstance(param, DTensor) else param


def _column_parallel(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # ``x`` went through ``f`` once for every layer reading it, in the parent's ``projections`` (SharedColumnInput).
    return F.linear(x, _local(module, "weight"), _local(module, "bias"))


def _row_parallel(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = sum_over(F.linear(x, _local(module, "weight")), module.tp_group)
    bias = _local(module, "bias")
    return out if bias is None else out + bias


def _vocabulary_parallel_embedding(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    weight = _local(module, "weight")
    local_ids = input_ids - module.tp_coordinate * weight.shape[0]
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    embedded = F.embedding(local_ids.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0)
    return sum_over(embedded, module.tp_group)


def _compute_locally(module: nn.Module, mesh: DeviceMesh, forward: Callable) -> nn.Module:
    """``module``'s DTensor hooks replaced by ``forward`` on its local shards (module docstring)."""
    module._forward_pre_hooks.clear()  # distribute_module's input and output conversions, the only hooks yet
    module._forward_hooks.clear()
    module.tp_group, module.tp_coordinate = mesh.get_group(), mesh.get_local_rank()
    # Bound to the module, not a partial over it: TorchDynamo then traces one function for every layer (it guards a
    # partial by identity, so compiled blocks would recompile per layer).
    module.forward = types.MethodType(forward, module)
    return module


class ColumnParallel(ColwiseParallel):
    """``ColwiseParallel``'s split; the forward on local shards. The input's gradient is summed over tp by the
    parent module that feeds it (``SharedColumnInput``), which ``tensor_parallel_plan`` puts beside every column
    layer."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _compute_locally(super()._apply(module, device_mesh), device_mesh, _column_parallel)


class RowParallel(RowwiseParallel):
    """``RowwiseParallel``'s split (the input's last dimension sharded, the output replicated); the forward on local
    shards, its partial outputs summed over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return _compute_locally(super()._apply(module, device_mesh), device_mesh, _row_parallel)


class SharedColumnInput(ParallelStyle):
    """The parent of column-parallel layers that read one input (a ``MergeableProjections``: attention's q/k/v, a
    SwiGLU's gate/up): its ``projections`` applies Megatron's ``f`` to that input once for all of them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MergeableProjections):
            raise TypeError(f"column-parallel layers in a {type(module).__name__}: their input's gradient needs f")
        module.tp_group = device_mesh.get_group()
        return module


class VocabularyParallelEmbedding(RowwiseParallel):
    """An embedding's rows split over tp (``RowwiseParallel`` of a replicated input to a replicated output); the
    forward on local rows, the partial embeddings summed over tp."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Replicate())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Embedding), module
        return _compute_locally(super()._apply(module, device_mesh), device_mesh, _vocabulary_parallel_embedding)


DECODER_LAYER_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.self_attn.q_proj": ColumnParallel(),
    "model.layers.*.self_attn.k_proj": ColumnParallel(),
    "model.layers.*.self_attn.v_proj": ColumnParallel(),
    "model.layers.*.self_attn.o_proj": RowParallel(),
    "model.layers.*.mlp.gate_proj": ColumnParallel(),
    "model.layers.*.mlp.up_proj": ColumnParallel(),
    "model.layers.*.mlp.down_proj": RowParallel(),
}
"""The linear layers of every decoder layer and their TP split (LoRA adapters split the same way, ``models.lora``)."""

SHARED_EXPERT_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.mlp.shared_expert.gate_proj": ColumnParallel(),
    "model.layers.*.mlp.shared_expert.up_proj": ColumnParallel(),
    "model.layers.*.mlp.shared_expert.down_proj": RowParallel(),
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
        return _compute_locally(module, device_mesh, _head_norm)


def _head_norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, sum_gradient_over(module.weight, module.tp_group), module.eps)


HEAD_NORM_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.self_attn.q_norm": HeadNormParallel(),
    "model.layers.*.self_attn.k_norm": HeadNormParallel(),
}
"""The per-head query / key norms of a model with ``qk_norm``."""
