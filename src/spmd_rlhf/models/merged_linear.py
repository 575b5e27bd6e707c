"""Linear layers of one input merged into one matmul, in the generation copy of a model: decode is bound by the host's
kernel launches, and a layer's q/k/v projections (three matmuls, and three bias adds where they have biases) and a
SwiGLU's gate/up projections (two) become one matmul each.

``MergedLinear`` holds one ``[rows of all the layers, in]`` weight (and bias) and makes each layer's own parameters
views of it, under their own (Hugging Face) names: whatever writes those parameters in place (the reshard, the weight
sync, a load) fills the merged weight, and a CUDA graph captured on it stays valid. Its call is the one matmul and a
split of the output into the layers' outputs (views: no copy).

Under tensor parallelism each rank merges its own shards. The layers are column-parallel (each weight and bias
``Shard(0)`` over one TP mesh, the input replicated: ``ColwiseParallel()``), so this rank's slice of each layer's
output is its local rows of the merged matmul, what ``ColwiseParallel`` computes; the parameters stay DTensors whose
local tensors are the views. A layer with parameters besides its weight and bias (LoRA adapters) or split another way
is refused: it needs its own forward.

Only a model that is not trained is merged (``merge_projections`` refuses parameters that require gradients: the
merged matmul would give them none), so the trained model's parameters, sharding and checkpoints never change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from spmd_rlhf.collectives import gather_sequence, sum_gradient_over


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _check_mergeable(linears: tuple[nn.Linear, ...]) -> None:
    """Raise a ``ValueError`` saying why ``linears`` cannot share one matmul."""
    first = linears[0].weight
    for linear in linears:
        names = {name for name, _ in linear.named_parameters()}
        if not names <= {"weight", "bias"}:
            raise ValueError(
                f"cannot merge a linear layer holding {sorted(names - {'weight', 'bias'})} (LoRA adapters run in the "
                "layer's own forward); merge only a model without them"
            )
        if (linear.bias is None) != (linears[0].bias is None):
            raise ValueError("cannot merge linear layers of which only some have a bias")
        if linear.weight.shape[1] != first.shape[1]:
            raise ValueError(f"cannot merge linear layers of {first.shape[1]} and {linear.weight.shape[1]} inputs")
        for param in linear.parameters():
            if param.requires_grad:
                raise ValueError(
                    "cannot merge the projections of a model that is trained: the merged matmul gives the layers' "
                    "parameters no gradient; merge a generation copy (requires_grad_(False))"
                )
            if param.dtype != first.dtype or param.device != first.device:
                raise ValueError("cannot merge linear layers of different dtypes or devices")
            if isinstance(param, DTensor) != isinstance(first, DTensor):
                raise ValueError("cannot merge tensor-parallel linear layers with plain ones")
            if isinstance(param, DTensor) and (
                param.device_mesh != first.device_mesh or tuple(param.placements) != (Shard(0),)
            ):
                raise ValueError(
                    f"cannot merge a tensor-parallel linear layer placed {param.placements}: only column-parallel "
                    "layers (Shard(0) over one TP mesh) share one local matmul"
                )


def _merge(linears: tuple[nn.Linear, ...], name: str) -> torch.Tensor:
    """One tensor holding the local rows of every layer's parameter ``name`` (their current values), each layer's
    parameter replaced by a view of its rows; holds, until the old parameters go, that parameter twice."""
    params = [getattr(linear, name) for linear in linears]
    merged = torch.cat([_local(param).detach() for param in params])
    offset = 0
    for linear, param in zip(linears, params):
        rows = _local(param).shape[0]
        view = merged[offset : offset + rows]
        offset += rows
        if isinstance(param, DTensor):
            view = DTensor.from_local(
                view, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        setattr(linear, name, nn.Parameter(view, requires_grad=False))
    return merged


class MergedLinear:
    """``linears`` (of one input) as one matmul whose output is split into theirs."""

    def __init__(self, linears: tuple[nn.Linear, ...]) -> None:
        _check_mergeable(linears)
        self.linears = linears
        self.merge()

    def merge(self) -> None:
        """Allocate the merged weight (and bias) from the layers' current values and make the layers' parameters
        views of it: at construction, and again whenever the layers' parameters got storage of their own (``to``,
        ``to_empty``)."""
        self.weight = _merge(self.linears, "weight")
        self.bias = _merge(self.linears, "bias") if self.linears[0].bias is not None else None
        self.sizes = [_local(linear.weight).shape[0] for linear in self.linears]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The one matmul: every layer's output side by side in the last dimension, in ``linears``' order."""
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x).split(self.sizes, dim=-1)


class MergeableProjections(nn.Module):
    """A module whose linear layers ``MERGEABLE`` all read the same input, which ``projections`` runs: each layer in
    turn, or once merged (``merge_projections``) one matmul."""

    MERGEABLE: tuple[str, ...] = ()
    """The child linear layers that read one input, in the order ``projections`` returns their outputs."""
    merged: MergedLinear | None = None
    tp_group: dist.ProcessGroup | None = None
    """Under tensor parallelism, the group over which the layers are column-parallel (``tp_plan.SharedColumnInput``):
    ``projections`` sums the input's gradient over it (Megatron's ``f``), once for all the layers."""
    sequence_parallel = False
    """With ``tp_group``: the input is this rank's chunk of the row, which ``projections`` gathers from the group."""

    def merge_projections(self) -> None:
        """Run the ``MERGEABLE`` layers as one matmul from now on (``MergedLinear``)."""
        self.merged = MergedLinear(tuple(getattr(self, name) for name in self.MERGEABLE))

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each ``MERGEABLE`` layer's output for ``x``."""
        if self.merged is not None:
            return self.merged(x)  # a generation copy: no gradient to sum
        if self.tp_group is not None:
            x = (gather_sequence if self.sequence_parallel else sum_gradient_over)(x, self.tp_group)
        return tuple(getattr(self, name)(x) for name in self.MERGEABLE)

    def _apply(self, fn, recurse=True):
        # Moving or converting (to, to_empty, cuda) gives every parameter storage of its own: merge it again.
        super()._apply(fn, recurse)
        if self.merged is not None:
            self.merged.merge()
        return self


def merge_projections(model: nn.Module) -> int:
    """Merge the projections of every ``MergeableProjections`` module of ``model`` (a generation copy whose
    parameters require no gradient, materialised: merging keeps the parameters' current values); returns how many
    modules it merged. Holds, besides the model, one module's projection weights at a time."""
    modules = [module for module in model.modules() if isinstance(module, MergeableProjections)]
    for module in modules:
        module.merge_projections()
    return len(modules)
