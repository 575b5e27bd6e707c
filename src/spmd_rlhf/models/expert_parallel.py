"""Expert parallelism: a mixture-of-experts layer's routed experts split over the ranks of an ``ep`` group, each
token copy sent by all-to-all to the rank that holds its expert and its output sent back.

Every rank of the group runs the same router on its own tokens (its own rows of the batch, as under data
parallelism) and holds ``E / ep`` consecutive experts: rank ``r`` the experts ``[r E/ep, (r + 1) E/ep)``, dim 0 of
each 3-D expert weight (``models.moe``'s layout; ``ParallelExperts`` keeps the parameter names), so
``shard_experts`` cuts the slices FSDP2 would. One layer's
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

from spmd_rlhf.models.moe import Experts, MoEBlock, Routing, combine


class ParallelExperts(Experts):
    """This rank's ``E / ep`` of an ``Experts`` module's experts (the same parameter names, dim 0 cut), whose
    forward dispatches token copies over ``group`` (module docstring). Build it with ``shard_experts``."""

    def __init__(self, experts: Experts, group: dist.ProcessGroup) -> None:
        nn.Module.__init__(self)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if experts.num_experts % size:
            raise ValueError(
                f"ep={size} does not divide the model's {experts.num_experts} experts: choose an ep that divides it"
            )
        self.num_experts, self.hidden_size = experts.num_experts, experts.hidden_size
        self.intermediate_size, self.grouped_mm = experts.intermediate_size, experts.grouped_mm
        self.group, self.size = group, size
        self.local = experts.num_experts // size
        """Experts held here: global ids ``[rank * local, (rank + 1) * local)``."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            weight = getattr(experts, name)
            piece = weight.detach()[rank * self.local : (rank + 1) * self.local].clone()
            setattr(self, name, nn.Parameter(piece, requires_grad=weight.requires_grad))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``x`` ``[tokens, H]`` -> the weighted sum of each token's ``k`` experts ``[tokens, H]``."""
        size, local = self.size, self.local
        routed, order, counts = self.sort_by_expert(x, routing)

        # received[s * local + e]: the copies rank s sends to this rank's local expert e.
        received = _wait(all_to_all_single(counts, None, None, self.group))
        splits = torch.cat([counts.view(size, local).sum(1), received.view(size, local).sum(1)]).tolist()  # sync
        sent_splits, received_splits = splits[:size], splits[size:]

        arrived = all_to_all_single_autograd(routed, received_splits, sent_splits, self.group)
        local_ids = torch.arange(local, device=x.device).repeat(size)
        by_expert = local_ids.repeat_interleave(received, output_size=sum(received_splits)).argsort(stable=True)
        local_counts = received.view(size, local).sum(0)
        rows = arrived.index_select(0, by_expert)
        outputs = self.run_experts(rows, local_counts, like=x)
        in_arrival_order = torch.empty_like(outputs).index_copy_(0, by_expert, outputs)
        returned = all_to_all_single_autograd(in_arrival_order, sent_splits, received_splits, self.group)
        return combine(returned, order, routing)


def shard_experts(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Replace every MoE layer's ``experts`` in ``model`` by this rank's ``ParallelExperts`` over ``group``."""
    for module in list(model.modules()):
        if isinstance(module, MoEBlock) and not isinstance(module.experts, ParallelExperts):
            module.experts = ParallelExperts(module.experts, group)


def all_to_all_bytes(*, tokens: int, top_k: int, hidden: int, ep: int, dtype_bytes: int) -> float:
    """Bytes one rank sends to other ranks in one direction of one layer's dispatch under uniform routing: its
    ``tokens · k`` copies of ``hidden`` elements, ``(ep - 1) / ep`` of them bound for another rank."""
    return tokens * top_k * hidden * dtype_bytes * (ep - 1) / ep


def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor."""
    return tensor.wait() if hasattr(tensor, "wait") else tensor
