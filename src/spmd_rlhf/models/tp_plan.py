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

Sequence parallelism (``sequence_parallel=True``, Megatron's): between the TP regions, each rank keeps its chunk of
the packed row (``[1, tokens / tp, hidden]``, the row padded to a multiple of tp: ``DecoderLM.hidden_states``), so the
residual stream and the norms' activations, replicated over tp otherwise, are split: ``f`` becomes an all-gather of
the row (a reduce-scatter in the backward, ``gather_sequence``) and ``g`` a reduce-scatter (an all-gather in the
backward, ``sum_scattered_sequence``), the same bytes as the all-reduces they replace. The norms' weights (and a
row-parallel bias), applied to each rank's own tokens, take their gradients summed over tp; the final norm gathers
the row for the head.

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

from spmd_rlhf.collectives import (
    gather_sequence_for_replicas,
    sum_gradient_over,
    sum_over,
    sum_scattered_sequence,
)
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


def _sequence_parallel_row(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = sum_scattered_sequence(F.linear(x, _local(module, "weight")), module.tp_group)
    bias = _local(module, "bias")  # added to this rank's tokens: its gradient summed over tp
    return out if bias is None else out + sum_gradient_over(bias, module.tp_group, copy=True)


def _partial_embedding(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    weight = _local(module, "weight")
    local_ids = input_ids - module.tp_coordinate * weight.shape[0]
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    return F.embedding(local_ids.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0)


def _vocabulary_parallel_embedding(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return sum_over(_partial_embedding(module, input_ids), module.tp_group)


def _sequence_parallel_embedding(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return sum_scattered_sequence(_partial_embedding(module, input_ids), module.tp_group)


def _norm_summing_weight_gradient(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, sum_gradient_over(module.weight, module.tp_group), module.eps)


def _gathering_norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    # The head runs whole on every rank (the LM head's input replicated, its gradient all-reduced; a value or score
    # head replicated): its gradient arrives the same on every rank.
    return gather_sequence_for_replicas(_norm_summing_weight_gradient(module, x), module.tp_group)


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
    shards, its partial outputs summed over tp (``sequence_parallel``: reduce-scattered over the row)."""

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        forward = _sequence_parallel_row if self.sequence_parallel else _row_parallel
        module.sequence_parallel = self.sequence_parallel  # its output a chunk of the row (a LoRA adapter reads it)
        return _compute_locally(super()._apply(module, device_mesh), device_mesh, forward)


class SharedColumnInput(ParallelStyle):
    """The parent of column-parallel layers that read one input (a ``MergeableProjections``: attention's q/k/v, a
    SwiGLU's gate/up): its ``projections`` applies Megatron's ``f`` to that input once for all of them
    (``sequence_parallel``: gathers the row from every rank's chunk)."""

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MergeableProjections):
            raise TypeError(f"column-parallel layers in a {type(module).__name__}: their input's gradient needs f")
        module.tp_group, module.sequence_parallel = device_mesh.get_group(), self.sequence_parallel
        return module


class VocabularyParallelEmbedding(RowwiseParallel):
    """An embedding's rows split over tp (``RowwiseParallel`` of a replicated input to a replicated output); the
    forward on local rows, the partial embeddings summed over tp (``sequence_parallel``: reduce-scattered over the
    row, each rank keeping its chunk)."""

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__(input_layouts=Replicate(), output_layouts=Replicate())
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Embedding), module
        forward = _sequence_parallel_embedding if self.sequence_parallel else _vocabulary_parallel_embedding
        return _compute_locally(super()._apply(module, device_mesh), device_mesh, forward)


class SequenceParallelNorm(ParallelStyle):
    """A decoder norm under sequence parallelism: applied to this rank's chunk of the row, its whole weight's
    gradient summed over tp; ``gather``: the row gathered after it (the final norm, before the head)."""

    def __init__(self, *, gather: bool = False) -> None:
        super().__init__()
        self.gather = gather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, RMSNorm), module
        forward = _gathering_norm if self.gather else _norm_summing_weight_gradient
        return _compute_locally(module, device_mesh, forward)


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
        return _compute_locally(module, device_mesh, _norm_summing_weight_gradient)


HEAD_NORM_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.self_attn.q_norm": HeadNormParallel(),
    "model.layers.*.self_attn.k_norm": HeadNormParallel(),
}
"""The per-head query / key norms of a model with ``qk_norm``."""
