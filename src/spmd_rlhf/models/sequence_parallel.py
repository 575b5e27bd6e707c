"""Sequence parallelism's row: under ``<role>.sequence_parallel`` each TP rank keeps ``1 / tp`` of a packed row's
tokens between the TP regions (``models.tp_plan``), so the row's length must be a multiple of tp. ``padded_row``
appends one padding sequence (token 0, positions from 0, its own entry in ``cu_seqlens``, so no real token attends to
it) and ``DecoderLM.hidden_states`` drops its hidden states again before the head (telling the row's
``RowPadding`` how many tokens it added). A pipeline's micro-batches and a context-parallel rank's chunk come padded
to a multiple of tp already.

Mixture-of-experts layers (``split_moe_rows``): the routed experts split each expert's width over tp and need every
rank's tokens, so an MoE block gathers the row (``gather_sequence_for_replicas``: the router's and the experts'
input gradients arrive summed over tp already), routes the row's real tokens (the padding is routed to no expert:
forward hooks, router replay and the router losses see the tokens they would without sequence parallelism), and
reduce-scatters the experts' partial outputs back to its chunk (``sum_scattered_sequence``). The shared expert
runs on the chunk through its own sequence-parallel styles, its one-output gate on the chunk with the gate weight's
gradient summed over tp."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from spmd_rlhf.collectives import gather_sequence_for_replicas, sum_gradient_over, sum_scattered_sequence
from spmd_rlhf.models.moe import MoEBlock, Routing

if TYPE_CHECKING:
    from spmd_rlhf.models.decoder import DecoderLM


@dataclass
class RowPadding:
    """The padding tokens at the end of the row the model is running (set by ``DecoderLM.hidden_states``)."""

    tokens: int = 0


def padded_row(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    multiple: int,
    *,
    chunk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int | None]:
    """``(input_ids, position_ids, cu_seqlens, max_seqlen)`` of a packed row ``[1, tokens]`` padded to a multiple of
    ``multiple`` tokens (unchanged where it is one already); a ``ValueError`` for padded rows (``attention_mask``) or
    a batch of several, which sequence parallelism does not split. ``chunk``: ``input_ids`` are a later pipeline
    stage's input (this rank's chunk of hidden states) or a context-parallel rank's chunk of the row, which cannot be
    padded here: it must be a multiple already, as the pipeline's micro-batching (``training.packing.stack_packed``)
    and context parallelism's rows (``training.context_parallel.ContextRow``) pad it."""
    if input_ids.shape[0] != 1 or attention_mask is not None:
        raise ValueError(
            "sequence parallelism splits one packed row (input_ids [1, tokens] with cu_seqlens), not padded rows "
            f"{tuple(input_ids.shape)}; pack the sequences or set <role>.sequence_parallel=false"
        )
    tokens = position_ids.shape[1]
    padding = -tokens % multiple
    if padding == 0:
        return input_ids, position_ids, cu_seqlens, max_seqlen
    if chunk:
        raise ValueError(
            f"sequence parallelism got a chunk of {tokens} tokens (a later pipeline stage's or a context-parallel "
            f"rank's), not a multiple of tp = {multiple}, which it cannot pad: pad the row before it is cut, "
            f"stack_packed(multiple={multiple}) or ContextRow.of(multiple={multiple})"
        )
    # Offsets made where they are, from what is there: a tensor built from host values would be a blocking copy to a
    # GPU (a wait for the stream) in every forward.
    if cu_seqlens is None:  # one sequence
        cu_seqlens = torch.arange(2, dtype=torch.int32, device=position_ids.device) * tokens
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:] + padding])
    input_ids = torch.cat([input_ids, input_ids.new_zeros(1, padding)], dim=1)
    position_ids = torch.cat([position_ids, torch.arange(padding, device=position_ids.device)[None]], dim=1)
    return input_ids, position_ids, cu_seqlens, None if max_seqlen is None else max(max_seqlen, padding)


def split_moe_rows(model: DecoderLM, mesh: DeviceMesh) -> None:
    """Every MoE block of ``model`` (its experts already split over ``mesh``'s tp, ``shard_experts``) takes its chunk
    of the row and returns its chunk (module docstring)."""
    for module in model.modules():
        if isinstance(module, MoEBlock):
            module.tp_group, module.row_padding = mesh.get_group(), model.row_padding
            module.forward = types.MethodType(_moe_on_chunks, module)


def _moe_on_chunks(self: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    hidden = x.shape[-1]
    flat = gather_sequence_for_replicas(x, self.tp_group).reshape(-1, hidden)
    real = flat.shape[0] - self.row_padding.tokens
    routing = self.gate(flat[:real])
    if real < flat.shape[0]:
        routing = _route_padding_nowhere(routing, flat.shape[0] - real)
    partial = self.experts(flat, routing, summed=False)
    out = sum_scattered_sequence(partial.view(1, -1, hidden), self.tp_group).view_as(x)
    if hasattr(self, "shared_expert"):
        gate_weight = sum_gradient_over(self.shared_expert_gate.weight, self.tp_group)  # each rank's own tokens
        out = out + torch.sigmoid(F.linear(x, gate_weight)) * self.shared_expert(x)
    return out


def _route_padding_nowhere(routing: Routing, padding: int) -> Routing:
    """``routing`` of the real tokens, extended by ``padding`` tokens sent to the first ``k`` experts with weight 0
    (their outputs, zeros, are dropped with them)."""
    k = routing.experts.shape[1]
    experts = torch.arange(k, device=routing.experts.device, dtype=routing.experts.dtype).expand(padding, k)
    return Routing(
        F.pad(routing.logits, (0, 0, 0, padding)),
        torch.cat([routing.experts, experts]),
        F.pad(routing.weights, (0, 0, 0, padding)),
    )
