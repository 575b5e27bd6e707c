"""Expert parallelism: a mixture-of-experts layer's routed experts split over the ranks of an ``ep`` group, each
token copy sent by all-to-all to the rank that holds its expert and its output sent back; and, composed with it or
alone, tensor parallelism of the experts (each expert's intermediate width split over ``tp``).

Every rank of the group runs the same router on its own tokens (its own rows of the batch, as under data
parallelism) and holds ``E / ep`` consecutive experts: rank ``r`` the experts ``[r E/ep, (r + 1) E/ep)``. Each 3-D
expert weight (``models.moe``'s layout; ``ParallelExperts`` keeps the parameter names) becomes a DTensor sharded on
dim 0 over the ``ep`` mesh, so loading, DCP checkpoints, the Hugging Face export and global-norm clipping see its
place in the whole tensor, and FSDP2 shards it further over ``efsdp`` (``parallelize``). One layer's
forward, per rank:

1. sort this rank's token copies by their (global) expert: the copies bound for rank ``j`` are then one run;
2. exchange the per-expert counts (a small all-to-all of ``E`` integers) and read the split sizes on the host: the
   layer's one sync, which an all-to-all with uneven splits needs (as TorchTitan's and Megatron's do);
3. all-to-all the copies (``all_to_all_single_autograd``: the backward is the reverse exchange);
4. order the received copies by local expert (they arrive by source rank, each run by expert), run the local experts
   (grouped GEMM or the looped fallback, ``Experts._grouped`` / ``_looped``), restore the arrival order;
5. all-to-all the outputs back and combine each token's ``k`` outputs with its routing weights, as one rank does.

Bytes per layer and rank, each way: the copies sent to other ranks, ``H`` elements each; with uniform routing
``tokens · k · (ep - 1) / ep · H`` elements (``all_to_all_bytes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from spmd_rlhf.collectives import sum_gradient_over, sum_over
from spmd_rlhf.models.moe import Experts, MoEBlock, Routing, combine


def check_expert_parallel(num_experts: int | None, ep: int, *, key: str = "ep") -> None:
    """A one-line error naming ``key`` unless ``ep`` ranks can split ``num_experts`` experts evenly (None: a model
    without mixture-of-experts layers, which ``ep > 1`` cannot split)."""
    if num_experts is None and ep > 1:
        raise ValueError(f"{key}={ep} but the model has no mixture-of-experts layers to split; set {key}=1")
    if num_experts is not None and num_experts % ep:
        raise ValueError(
            f"{key}={ep} does not divide the model's {num_experts} experts: choose an {key} that divides it"
        )


class ParallelExperts(Experts):
    """An ``Experts`` module split over ``mesh``, each of whose dimensions ``split`` names: ``"ep"`` splits the
    experts (dim 0 of every weight: ``E / ep`` consecutive experts per rank, token copies dispatched by all-to-all:
    module docstring); ``"tp"`` splits each expert's intermediate width (gate and up on dim 1, down on dim 2: every TP
    rank routes the same tokens and runs its slice of their experts, and the partial outputs are summed over tp, as a
    column- then row-parallel MLP does). The weights are DTensors over ``mesh`` with the same parameter names. Build
    it with ``shard_experts``; on the meta device nothing is communicated."""

    def __init__(self, experts: Experts, mesh: DeviceMesh, *, split: tuple[str, ...] = ("ep",)) -> None:
        nn.Module.__init__(self)
        assert len(split) == mesh.ndim and set(split) <= {"ep", "tp"}, (split, mesh)
        self.num_experts, self.hidden_size = experts.num_experts, experts.hidden_size
        self.intermediate_size, self.grouped_mm = experts.intermediate_size, experts.grouped_mm
        self.group, self.size, self.tp_group = None, 1, None
        if "ep" in split:
            dim = split.index("ep")
            self.size = mesh.size(dim)
            check_expert_parallel(experts.num_experts, self.size)
            self.group = mesh.get_group(dim)
            # The all-to-all orders its splits by group rank, the DTensor its shards by mesh coordinate: one order.
            assert dist.get_rank(self.group) == mesh.get_local_rank(dim), "an ep mesh out of its group's rank order"
        if "tp" in split:
            self.tp_group = mesh.get_group(split.index("tp"))
        self.local = experts.num_experts // self.size
        """Experts held here: global ids ``[rank * local, (rank + 1) * local)``."""
        for name, width_dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
            weight = getattr(experts, name)
            placements = [Shard(0) if what == "ep" else Shard(width_dim) for what in split]
            # src_data_rank=None: each rank keeps its own piece of its (identical) whole weight, no scatter.
            sharded = distribute_tensor(weight.detach(), mesh, placements, src_data_rank=None)
            setattr(self, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's ``[E / ep, I / tp, H]`` (down: ``[E / ep, H, I / tp]``) pieces (FSDP gathers them over
        efsdp, or dp, before the forward)."""
        return tuple(
            weight.to_local() if isinstance(weight, DTensor) else weight
            for weight in (self.gate_proj, self.up_proj, self.down_proj)
        )

    def forward(self, x: torch.Tensor, routing: Routing, *, summed: bool = True) -> torch.Tensor:
        """``x`` ``[tokens, H]`` -> the weighted sum of each token's ``k`` experts ``[tokens, H]``; under tp, not
        ``summed``: this rank's partial sum, for the caller to reduce (sequence parallelism reduce-scatters it)."""
        if self.tp_group is not None:
            # Each TP rank's copies feed its slice of the experts, so the copies' and the routing weights'
            # gradients are partial sums over tp (the router's own gradient is then whole on every rank).
            x = sum_gradient_over(x, self.tp_group)
            routing = routing._replace(weights=sum_gradient_over(routing.weights, self.tp_group))
        routed, order, counts = self.sort_by_expert(x, routing)
        if self.group is None:
            outputs = self.run_experts(routed, counts, like=x)
        else:
            outputs = self._dispatched(routed, counts, like=x)
        out = combine(outputs, order, routing)
        return out if self.tp_group is None or not summed else sum_over(out, self.tp_group)

    def _dispatched(self, routed: torch.Tensor, counts: torch.Tensor, *, like: torch.Tensor) -> torch.Tensor:
        """The local experts' outputs of this rank's ``routed`` copies (sorted by expert, ``counts`` per expert),
        each copy sent to the rank holding its expert and its output sent back (steps 2-5 of the module docstring)."""
        size, local = self.size, self.local
        # received[s * local + e]: the copies rank s sends to this rank's local expert e.
        received = _wait(all_to_all_single(counts, None, None, self.group))
        splits = torch.cat([counts.view(size, local).sum(1), received.view(size, local).sum(1)]).tolist()  # sync
        sent_splits, received_splits = splits[:size], splits[size:]

        arrived = all_to_all_single_autograd(routed, received_splits, sent_splits, self.group)
        local_ids = torch.arange(local, device=routed.device).repeat(size)
        by_expert = local_ids.repeat_interleave(received, output_size=sum(received_splits)).argsort(stable=True)
        local_counts = received.view(size, local).sum(0)
        rows = arrived.index_select(0, by_expert)
        outputs = self.run_experts(rows, local_counts, like=like)
        in_arrival_order = torch.empty_like(outputs).index_copy_(0, by_expert, outputs)
        return all_to_all_single_autograd(in_arrival_order, sent_splits, received_splits, self.group)


def shard_experts(model: nn.Module, mesh: DeviceMesh, *, split: tuple[str, ...] = ("ep",)) -> None:
    """Replace every MoE layer's ``experts`` in ``model`` by this rank's ``ParallelExperts`` over ``mesh``, whose
    dimensions ``split`` names (``"ep"``, ``"tp"``)."""
    for module in list(model.modules()):
        if isinstance(module, MoEBlock) and not isinstance(module.experts, ParallelExperts):
            module.experts = ParallelExperts(module.experts, mesh, split=split)


def all_to_all_bytes(*, tokens: int, top_k: int, hidden: int, ep: int, dtype_bytes: int) -> float:
    """Bytes one rank sends to other ranks in one direction of one layer's dispatch under uniform routing: its
    ``tokens · k`` copies of ``hidden`` elements, ``(ep - 1) / ep`` of them bound for another rank."""
    return tokens * top_k * hidden * dtype_bytes * (ep - 1) / ep


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor."""
    return tensor.wait() if hasattr(tensor, "wait") else tensor
