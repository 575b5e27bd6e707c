"""The flat all-gather and reduce-scatter under the names this torch has: 2.13 renames ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` to ``all_gather_single`` and ``reduce_scatter_single`` (the old names kept, deprecated);
2.11 has only the old ones. And Megatron's two tensor-parallel autograd operators, ``sum_gradient_over`` (``f``) and
``sum_over`` (``g``), for layers split by hand rather than by a DTensor plan (LoRA adapters, experts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

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
