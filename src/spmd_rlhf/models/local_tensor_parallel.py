"""A generation copy's tensor parallelism on local tensors, with nothing that serves a backward: the forwards of its
TP-split modules read their parameters' local shards (looked up once per parameter, not once per call) and call the
collectives themselves.

``parallelize(..., gather_logits=True)`` splits the generation copy as it splits a trained model: DTensor parameters,
the decoder layers and the embedding computing on local shards through Megatron's autograd operators
(``models.tp_plan``: a ``to_local()`` and an autograd function per call), and the LM head through
``ColwiseParallel``'s hooks that wrap its input in a DTensor and gather its output. A decode step is bound by the host
(``benchmarks/tp_decode_host.py`` times the DTensor path against this one). ``run_locally`` keeps the
parameters DTensors (their global shapes and placements are what the reshard, the weight sync and the schedule
agreement read, and writes into their local tensors in place are what the forwards see) and replaces the forwards,
Megatron's way without autograd, per TP rank:

- column-parallel linears (q, k, v, gate, up; merged or not): ``x W_local^T + b_local``, the input replicated;
- row-parallel linears (o, down): ``all_reduce(x_local W_local^T) + b``;
- each of those products through ``torch.ops.spmd_rlhf.skinny_linear`` where ``engine.decode_matmul`` gave the
  module ``skinny_kernels`` (decode's few rows, ``rollout.decode_matmul=triton``), else ``F.linear``;
- the vocabulary-parallel embedding: each rank looks up the ids in its rows (zeros elsewhere), then an all-reduce;
- the LM head: this rank's vocabulary columns of the logits, all-gathered in mesh order (the sampler reads whole
  logits on every rank, as ``gather_logits`` did).

A module's local tensors are read once per parameter object (``_Shards``): a parameter replaced later (``to``,
``tie_weights``, a merge) is picked up at its next call. Where TorchDynamo traces the forwards (the decode blocks
compiled around attention, ``engine.decode_graphs``) they read ``to_local()`` of the DTensor instead, and the
collectives become functional ones inside the graph. For generation only: nothing here has a backward.
"""

from __future__ import annotations

import math
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.merged_linear import MergeableProjections
from spmd_rlhf.models.parallelize import tensor_parallel_plan


class _Shards:
    """The local tensors of a module's (DTensor) parameters, looked up again only when a parameter is replaced."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.seen: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    def __call__(self, name: str) -> torch.Tensor | None:
        param = getattr(self.module, name)
        seen = self.seen.get(name)
        if seen is None or seen[0] is not param:
            seen = (param, param.to_local() if isinstance(param, DTensor) else param)
            self.seen[name] = seen
        return seen[1]


def run_locally(model: DecoderLM, mesh: DeviceMesh) -> None:
    """Every module of ``model`` that ``parallelize(model, tp_mesh=mesh, gather_logits=True)`` split computes on its
    local shards with explicit collectives over ``mesh`` (module docstring); its DTensor hooks go. Nothing to do
    for a mesh of one rank."""
    if mesh.size() == 1:
        return
    model.local_tensor_parallel = True
    group, coordinate = mesh.get_group(), mesh.get_local_rank()
    # all_gather lists by group rank; the shards lie by mesh coordinate (a generation mesh may order its ranks so).
    gather_order = [dist.get_group_rank(group, rank) for rank in mesh.mesh.flatten().tolist()]
    for name, style in tensor_parallel_plan(model, gather_logits=True).items():
        module = model.get_submodule(name)
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            # Per-head norms: their one weight is whole on every rank, their forward already local. A column
            # layers' parent: no gradient to sum.
            if isinstance(module := model.get_submodule(name), MergeableProjections):
                module.tp_group = None
            continue
        module._forward_pre_hooks.clear()  # DTensor's input and output conversions (distribute_module's hooks)
        module._forward_hooks.clear()
        module.local_shards = _Shards(module)
        module.tp_group, module.tp_coordinate, module.tp_gather_order = group, coordinate, gather_order
        if isinstance(module, nn.Embedding):
            forward = _vocabulary_parallel_embedding
        elif name == "lm_head":
            forward = _gathered_logits
        elif isinstance(style, RowwiseParallel):
            forward = _row_parallel
        else:
            forward = _column_parallel
        # Bound to the module, not a partial over its state: TorchDynamo then traces one function for every layer
        # (it guards a partial by identity, so compiled blocks would recompile per layer).
        module.forward = types.MethodType(forward, module)


def local_parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    """``module``'s parameter ``name`` as this rank's local tensor: looked up once per parameter object in eager
    calls (``_Shards``), read from the DTensor where TorchDynamo traces (its guards then hold for every layer)."""
    if torch.compiler.is_compiling():
        param = getattr(module, name)
        return param.to_local() if isinstance(param, DTensor) else param
    return module.local_shards(name)


def takes_rows(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (its leading dimensions) go through the skinny-linear operator ``engine.decode_matmul``
    pointed ``module`` at: at most its ``skinny_rows`` (its tiling's ``max_rows``)."""
    return getattr(module, "skinny_kernels", None) is not None and math.prod(x.shape[:-1]) <= module.skinny_rows


def skinny_or_linear(
    module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (a TP replica's local shards, or a whole layer's), or the skinny-linear operator
    where ``engine.decode_matmul`` pointed ``module`` at it (its ``skinny_kernels``: the operator's backend and
    tiling) and ``x`` has few enough rows (``takes_rows``)."""
    if not takes_rows(module, x):
        return F.linear(x, weight, bias)
    return torch.ops.spmd_rlhf.skinny_linear(x, weight, bias, *module.skinny_kernels)


def summed_over_ranks(module: nn.Module, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel module's output from this rank's partial product (its input shard times its weight shard):
    summed over the TP group, then the (whole) bias added."""
    dist.all_reduce(partial, group=module.tp_group)
    bias = local_parameter(module, "bias")
    return partial if bias is None else partial + bias


def _column_parallel(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return skinny_or_linear(module, x, local_parameter(module, "weight"), local_parameter(module, "bias"))


def _row_parallel(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return summed_over_ranks(module, skinny_or_linear(module, x, local_parameter(module, "weight"), None))


def _vocabulary_parallel_embedding(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    weight = local_parameter(module, "weight")
    local_ids = input_ids - module.tp_coordinate * weight.shape[0]
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    embedded = F.embedding(local_ids.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0)
    dist.all_reduce(embedded, group=module.tp_group)
    return embedded


def _gathered_logits(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    local = F.linear(x, local_parameter(module, "weight"), local_parameter(module, "bias")).contiguous()
    pieces = [torch.empty_like(local) for _ in module.tp_gather_order]
    dist.all_gather(pieces, local, group=module.tp_group)
    return torch.cat([pieces[rank] for rank in module.tp_gather_order], dim=-1)
