"""The flat all-gather and reduce-scatter under the names this torch has: 2.13 renames ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` to ``all_gather_single`` and ``reduce_scatter_single`` (the old names kept, deprecated);
2.11 has only the old ones. And Megatron's two tensor-parallel autograd operators, ``sum_gradient_over`` (``f``) and
``sum_over`` (``g``), for layers split by hand rather than by a DTensor plan (LoRA adapters, experts), with their
sequence-parallel counterparts ``gather_sequence`` and ``sum_scattered_sequence``."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_flat(output, input, group=...)``: every rank's ``input`` laid end to end in ``output``."""

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_flat(output, input, group=...)``: this rank's part of the sum of every rank's ``input``."""


class _SumGradientOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group`` (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, copy: bool) -> torch.Tensor:
        ctx.group = group
        return tensor.clone() if copy else tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _SumOverGroup(torch.autograd.Function):
    """Sum over ``group`` forward; identity backward, the gradient being the same on every rank (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        # The functional all-reduce (out of place): torch 2.11's TorchDynamo, tracing the in-place one on a clone here,
        # gave the output no gradient (a compiled block's row-parallel layers, and all before them, got zeros).
        return functional.wait_tensor(functional.all_reduce(tensor.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_gradient_over(tensor: torch.Tensor, group: dist.ProcessGroup, *, copy: bool = False) -> torch.Tensor:
    """``tensor`` unchanged, its gradient summed over ``group`` in the backward (the input of a split layer that
    every rank of ``group`` feeds the same tensor). A view of ``tensor``, or with ``copy`` a copy: for a small
    ``tensor`` that is itself a view made by a custom autograd function (a DTensor's ``to_local()``), whose view
    TorchDynamo refuses to trace."""
    return _SumGradientOverGroup.apply(tensor, group, copy)


def sum_over(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over ``group`` (a new tensor), its gradient passed through unchanged (the partial outputs of
    a split layer)."""
    return _SumOverGroup.apply(tensor, group)


def _gathered(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[1, t, ...]`` chunks over ``group`` -> ``[1, n t, ...]`` in rank order (a new tensor, not a view: a view
    made inside an autograd function is what TorchDynamo refuses as a compiled block's input)."""
    chunk = tensor[0].contiguous()
    out = chunk.new_empty((1, dist.get_world_size(group) * chunk.shape[0], *chunk.shape[1:]))
    all_gather_flat(out[0], chunk, group=group)
    return out


def _scattered(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[1, T, ...]`` partial results over ``group`` -> this rank's chunk ``[1, T / n, ...]`` of their sum."""
    whole = tensor[0].contiguous()
    out = whole.new_empty((1, whole.shape[0] // dist.get_world_size(group), *whole.shape[1:]))
    reduce_scatter_flat(out[0], whole, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, replicated_gradient: bool) -> torch.Tensor:
        ctx.group, ctx.replicated_gradient = group, replicated_gradient
        ctx.chunk, ctx.rank = tensor.shape[1], dist.get_rank(group)
        return _gathered(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.replicated_gradient:
            return grad[:, ctx.rank * ctx.chunk : (ctx.rank + 1) * ctx.chunk].contiguous(), None, None
        return _scattered(grad, ctx.group), None, None


class _SumScatteredSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _scattered(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gathered(grad, ctx.group), None


def gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[1, tokens / n, ...]`` chunks of one row, laid end to end over ``group`` in rank order: ``[1, tokens,
    ...]``; the backward sums the gradient over ``group`` and hands each rank its chunk's (sequence parallelism's
    ``f``: an all-gather, then a reduce-scatter in the backward)."""
    return _GatherSequence.apply(tensor, group, False)


def gather_sequence_for_replicas(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``gather_sequence`` for a consumer that every rank of ``group`` runs whole (a replicated head, whose own
    gradient is summed over the group already): the gradient arrives the same on every rank, so the backward keeps
    this rank's chunk of it, no collective (Megatron's gather with ``tensor_parallel_output_grad=False``)."""
    return _GatherSequence.apply(tensor, group, True)


def sum_scattered_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of ``[1, tokens, ...]`` partial results of one row, each rank keeping its chunk ``[1,
    tokens / n, ...]`` (``tokens`` a multiple of ``n``); the backward all-gathers the chunks' gradients (sequence
    parallelism's ``g``: a reduce-scatter, then an all-gather in the backward)."""
    return _SumScatteredSequence.apply(tensor, group)
