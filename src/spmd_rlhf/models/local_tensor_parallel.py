"""A generation copy's tensor parallelism on local tensors: the forwards of its TP-split modules read their
parameters' local shards and call the collectives themselves, instead of going through DTensor's dispatch.

``parallelize(..., gather_logits=True)`` splits the generation copy as it splits a trained model: DTensor parameters
and ``ColwiseParallel`` / ``RowwiseParallel`` hooks that wrap every input in a DTensor, redistribute the output and
unwrap it. Every such call costs host work, and a decode step is bound by the host (``benchmarks/tp_decode_host.py``
times both paths). ``run_locally`` keeps the
parameters DTensors (their global shapes and placements are what the reshard, the weight sync and the schedule
agreement read, and writes into their local tensors in place are what the forwards see) and replaces the forwards,
Megatron's way, per TP rank:

- column-parallel linears (q, k, v, gate, up; merged or not): ``x W_local^T + b_local``, the input replicated;
- row-parallel linears (o, down): ``all_reduce(x_local W_local^T) + b``;
- the vocabulary-parallel embedding: each rank looks up the ids in its rows (zeros elsewhere), then an all-reduce;
- the LM head: this rank's vocabulary columns of the logits, all-gathered in mesh order (the sampler reads whole
  logits on every rank, as ``gather_logits`` did).

A module's local tensors are read once per parameter object (``_Shards``): a parameter replaced later (``to``,
``tie_weights``, a merge) is picked up at its next call. For generation only: nothing here has a backward.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from spmd_rlhf.models.decoder import DecoderLM
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
            continue  # per-head norms: their one weight is whole on every rank, their forward already local
        module._forward_pre_hooks.clear()  # DTensor's input and output conversions (distribute_module's hooks)
        module._forward_hooks.clear()
        shards = _Shards(module)
        if isinstance(module, nn.Embedding):
            module.forward = functools.partial(_vocabulary_parallel_embedding, shards, group, coordinate)
        elif name == "lm_head":
            module.forward = functools.partial(_gathered_logits, shards, group, gather_order)
        elif isinstance(style, RowwiseParallel):
            module.forward = functools.partial(_row_parallel, shards, group)
        else:
            module.forward = functools.partial(_column_parallel, shards)


def _column_parallel(shards: _Shards, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, shards("weight"), shards("bias"))


def _row_parallel(shards: _Shards, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, shards("weight"))
    dist.all_reduce(out, group=group)
    bias = shards("bias")
    return out if bias is None else out + bias


def _vocabulary_parallel_embedding(
    shards: _Shards, group: dist.ProcessGroup, coordinate: int, input_ids: torch.Tensor
) -> torch.Tensor:
    weight = shards("weight")
    local_ids = input_ids - coordinate * weight.shape[0]
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    embedded = F.embedding(local_ids.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0)
    dist.all_reduce(embedded, group=group)
    return embedded


def _gathered_logits(
    shards: _Shards, group: dist.ProcessGroup, gather_order: list[int], x: torch.Tensor
) -> torch.Tensor:
    local = F.linear(x, shards("weight"), shards("bias")).contiguous()
    pieces = [torch.empty_like(local) for _ in gather_order]
    dist.all_gather(pieces, local, group=group)
    return torch.cat([pieces[rank] for rank in gather_order], dim=-1)
