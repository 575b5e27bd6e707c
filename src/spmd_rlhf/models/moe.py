"""The mixture-of-experts feed-forward block of Qwen3-MoE, Qwen2-MoE (with a gated shared expert) and Mixtral.

A router picks ``top_k`` of ``num_experts`` SwiGLU experts per token (softmax over all experts, the top ``k``
probabilities, renormalised to sum to 1 where the family does so) and the block returns the probability-weighted sum
of their outputs (plus, in Qwen2-MoE, a dense shared expert scaled by ``sigmoid(shared_expert_gate(x))``).

Expert weights are one 3-D parameter per projection and layer, in ``nn.Linear``'s ``[out, in]`` layout per expert:

    experts.gate_proj [E, I, H]    experts.up_proj [E, I, H]    experts.down_proj [E, H, I]

Dim 0 is the expert, so FSDP2 (which shards dim 0) and a later expert-parallel split cut along experts, and expert
``e`` of each parameter is exactly the published checkpoint's ``experts.e.{gate,up,down}_proj.weight``: loading
reads a rectangle of it, export writes ``param[e]`` (``checkpoint_names``). Gate and up stay separate (transformers
5 concatenates them into ``gate_up_proj``) so that a column-parallel split of ``I`` needs no interleaving.

Two compute paths give the same result: grouped GEMMs (``torch._grouped_mm`` over the token copies sorted by expert,
group ends an int32 cumsum of the per-expert counts; no host sync), and a loop over experts for devices and dtypes
``_grouped_mm`` does not serve (one host sync per layer: the per-expert counts, to split the sorted tokens).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from spmd_rlhf.models.args import DecoderArgs
from spmd_rlhf.models.merged_linear import MergeableProjections


class Routing(NamedTuple):
    """What the router decided for ``tokens`` hidden states (a forward hook on ``mlp.gate`` sees it): the logits
    ``[tokens, E]`` (for a load-balancing loss or a z-loss), each token's experts ``[tokens, k]`` and their weights
    ``[tokens, k]`` in the compute dtype."""

    logits: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


def expert_load(routing: Routing, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert ``[E]`` (int64, on the device; a token counts once per expert it chose)."""
    return count_per_expert(routing.experts.flatten(), num_experts)


def count_per_expert(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How often each of ``num_experts`` experts occurs in ``chosen``: a scatter-add into ``[E]`` zeros, where
    ``torch.bincount`` would read the largest id back to the host on CUDA (and break a CUDA graph capture)."""
    return torch.zeros(num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
        0, chosen, torch.ones_like(chosen)
    )


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type of a record of expert ids (router replay) with -1 for "none": int8 up to 127
    experts, else int16."""
    return torch.int8 if num_experts <= 127 else torch.int16


class TopKRouter(nn.Module):
    """``softmax(x W^T)`` over the experts (in float32), the ``top_k`` largest (or the replayed experts), optionally
    renormalised."""

    def __init__(self, hidden_size: int, num_experts: int, *, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.replay: torch.Tensor | None = None
        """Router replay: expert ids ``[tokens, k]`` for the next forward's tokens, set from outside
        (``training.router_replay``); they replace the top-k choice (a row of -1: the router's own), and the weights
        are the router's probabilities at those experts, so gradients still reach the router."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _uniform_fan_in_(self.weight)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)
        probabilities = logits.softmax(-1, dtype=torch.float32)
        weights, experts = probabilities.topk(self.top_k, dim=-1)
        if self.replay is not None:
            experts = torch.where(self.replay >= 0, self.replay.to(experts.dtype), experts)
            weights = probabilities.gather(-1, experts)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(logits, experts, weights.to(x.dtype))


def _uniform_fan_in_(weight: torch.Tensor) -> None:
    """``nn.Linear``'s default initialisation per expert, skipped on the meta device (``Backbone`` says why)."""
    if not weight.is_meta:
        bound = 1 / math.sqrt(weight.shape[-1])
        nn.init.uniform_(weight, -bound, bound)


@functools.cache
def _grouped_mm_runs_on_cpu() -> bool:
    """Whether this torch has a CPU ``_grouped_mm`` (torch 2.13 does; older ones may not)."""
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_supported(x: torch.Tensor, hidden_size: int, intermediate_size: int) -> bool:
    """Whether ``torch._grouped_mm`` serves expert GEMMs on ``x``'s device and dtype without a host sync: rows of
    16-byte multiples; on CUDA bfloat16 on sm90 / sm100 (elsewhere torch falls back to a loop that reads the group
    ends on the host); on CPU float32 or bfloat16 where this torch has it."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any(size * x.element_size() % 16 for size in (hidden_size, intermediate_size)):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # torch's shape function for _grouped_mm, which a compiled block traces, takes bfloat16 only
    return _grouped_mm_serves(x.device, x.dtype)


@torch.compiler.assume_constant_result
def _grouped_mm_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """``grouped_mm_supported``'s device and dtype half; a constant to ``torch.compile`` (it probes the device, which a
    compiled block must not trace)."""
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16) and _grouped_mm_runs_on_cpu()
    return False


def combine(outputs: torch.Tensor, order: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The expert outputs of the sorted copies (``Experts.sort_by_expert``) as each token's weighted sum ``[tokens,
    H]``: back to (token, choice) order by a permutation, then a fixed-order sum over the k choices: deterministic,
    unlike an index_add of the copies onto their tokens (atomic adds on CUDA)."""
    tokens, top_k = routing.experts.shape
    unsorted = torch.empty_like(outputs).index_copy_(0, order, outputs).view(tokens, top_k, -1)
    return (unsorted * routing.weights.unsqueeze(-1)).sum(1)


class Experts(nn.Module):
    """``E`` SwiGLU experts held as three 3-D parameters (layout in the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.grouped_mm: bool | None = None
        """True / False forces the grouped-GEMM / looped path (tests compare them); None picks per call
        (``grouped_mm_supported``)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            _uniform_fan_in_(weight)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``x`` ``[tokens, H]`` -> ``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` ``[tokens, H]``."""
        routed, order, counts = self.sort_by_expert(x, routing)
        outputs = self.run_experts(routed, counts, like=x)
        return combine(outputs, order, routing)

    def sort_by_expert(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's k copies sorted by expert (stable: within an expert, in token order) ``[tokens * k, H]``, the
        permutation that sorted them (``combine`` undoes it) and the copies per expert ``[E]``."""
        chosen = routing.experts.flatten()
        order = chosen.argsort(stable=True)
        return x.index_select(0, order // routing.experts.shape[1]), order, count_per_expert(chosen, self.num_experts)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, *, like: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on its ``counts[e]`` consecutive ``rows``: grouped GEMMs where they serve inputs of ``like``'s
        device and dtype, else the loop."""
        return self._grouped(rows, counts) if self.uses_grouped_mm(like) else self._looped(rows, counts)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether a forward on inputs of ``x``'s device and dtype takes the grouped-GEMM path (else the loop, with its
        host sync)."""
        if self.grouped_mm is not None:
            return self.grouped_mm
        return grouped_mm_supported(x, self.hidden_size, self.intermediate_size)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gate, up and down weights of the experts this module runs (all of them here; this rank's share under
        expert parallelism)."""
        return self.gate_proj, self.up_proj, self.down_proj

    def _grouped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)
        gate_proj, up_proj, down_proj = self.expert_weights()
        gate = torch._grouped_mm(routed, gate_proj.transpose(-2, -1), offs=ends)
        up = torch._grouped_mm(routed, up_proj.transpose(-2, -1), offs=ends)
        return torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=ends)

    def _looped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        pieces = routed.split(counts.tolist())  # the per-expert counts on the host: this path's one sync
        # unbind, not indexing per expert: each index's backward would write a whole [E, ...] zero gradient.
        weights = zip(*(weight.unbind(0) for weight in self.expert_weights()))
        return torch.cat(
            [
                F.linear(F.silu(F.linear(piece, gate)) * F.linear(piece, up), down)
                for piece, (gate, up, down) in zip(pieces, weights)
            ]
        )


class SwiGLU(MergeableProjections):
    """``down(silu(gate(x)) * up(x))``: the dense MLP, and Qwen2-MoE's shared expert."""

    MERGEABLE = ("gate_proj", "up_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.projections(x)
        return self.down_proj(F.silu(gate) * up)


class MoEBlock(nn.Module):
    """Router (``gate``), routed experts (``experts``) and, when the config has one, a shared expert
    (``shared_expert``) scaled per token by ``sigmoid(shared_expert_gate(x))``; Hugging Face's module names."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        moe = args.moe
        self.gate = TopKRouter(
            args.hidden_size, moe.num_experts, top_k=moe.num_experts_per_tok, renormalize=moe.norm_topk_prob
        )
        self.experts = Experts(moe.num_experts, args.hidden_size, moe.moe_intermediate_size)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(args.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = self.experts(flat, self.gate(flat))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)
