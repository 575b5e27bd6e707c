"""Context parallelism: ``<role>.cp_attention`` picks how attention reads the whole row, Ulysses (below) or ring
(``models.ring_attention``: zig-zag chunks, any degree); ``auto`` takes Ulysses where ``cp`` splits the heads.

Ulysses: a packed row's tokens split over the ``cp`` ranks of a group, each rank
holding one contiguous chunk; attention alone needs every token, so around it an all-to-all trades the sequence split
for a head split.

    [1, T / cp, heads, d]  --all-to-all-->  [1, T, heads / cp, d]  --attend-->  --all-to-all-->  [1, T / cp, heads, d]

Everything else in a decoder layer (projections, rotary embeddings by each token's own position, norms, the MLP)
works token by token on the chunk as it is. Each rank attends with its ``heads / cp`` heads over the whole row
(``AttentionBatch`` of all ``T`` tokens: the packed sequences' ``cu_seqlens`` are the row's, not the chunk's), so
``cp`` must divide the query heads. Grouped-query attention with fewer key/value heads than ``cp`` replicates each
key/value head ``lcm(kv_heads, cp) / kv_heads`` times before the exchange (``replicated_kv_heads``): the key/value
traffic and the key/value activations of attention grow by that factor.

Bytes each rank sends per layer and direction: its chunk of q, k, v (forward in) and of the output (forward out),
``(cp - 1) / cp`` of each leaving the rank (``ulysses_bytes``); the backward sends as much again.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from spmd_rlhf.models.attention import AttentionBatch, attend
from spmd_rlhf.models.ring_attention import ring_attend

CP_ATTENTION = ("auto", "ulysses", "ring")
"""``<role>.cp_attention``'s values."""


def replicated_kv_heads(kv_heads: int, cp: int) -> int:
    """Key/value heads after replication, so that ``cp`` divides them: ``lcm(kv_heads, cp)``."""
    return math.lcm(kv_heads, cp)


def resolve_cp_attention(setting: str, *, heads: int, kv_heads: int, cp: int, role: str = "model") -> str:
    """``ulysses`` or ``ring`` for ``<role>.cp_attention`` = ``setting`` with ``heads`` / ``kv_heads`` per rank (after
    TP): ``auto`` takes Ulysses where it can split the heads, else ring; ``ulysses`` that cannot is a one-line error
    naming ``<role>.cp`` and the way out."""
    if setting not in CP_ATTENTION:
        raise ValueError(f"{role}.cp_attention={setting!r} is unknown; choose one of {', '.join(CP_ATTENTION)}")
    if setting == "ring":
        return "ring"
    try:
        check_ulysses(heads=heads, kv_heads=kv_heads, cp=cp, tokens=cp, key=f"{role}.cp")
    except ValueError as error:
        if setting == "auto":
            return "ring"
        raise ValueError(f"{error} (or set {role}.cp_attention=ring)") from None
    return "ulysses"


def apply_context_parallel(
    model: torch.nn.Module, group: dist.ProcessGroup, *, tp: int = 1, role: str = "model", attention: str = "auto"
) -> str:
    """Every attention layer of ``model`` attends over the whole packed row from this rank's chunk of it, by
    ``ulysses_attend`` or ``ring_attend`` over ``group`` (``resolve_cp_attention`` of ``attention`` with this rank's
    ``heads / tp``); returns which, also kept as ``model.context_parallel`` (the caller lays chunks out by it:
    contiguous for Ulysses, zig-zag for ring)."""
    args, cp = model.args, dist.get_world_size(group)
    chosen = resolve_cp_attention(
        attention, heads=args.num_heads // tp, kv_heads=args.num_kv_heads // tp, cp=cp, role=role
    )
    if chosen != attention and dist.get_rank(group) == 0:
        logging.getLogger(__name__).info(
            "%s.cp=%d: %s attention over the row (%s.cp_attention=auto; %d heads per rank)",
            role,
            cp,
            chosen,
            role,
            args.num_heads // tp,
        )
    attend_over_the_row = _ring_over_the_row if chosen == "ring" else _ulysses_over_the_row
    for module in model.modules():
        if hasattr(module, "attend") and hasattr(module, "q_proj"):
            module.attend = functools.partial(attend_over_the_row, group=group)
    model.context_parallel = chosen
    return chosen


def _ulysses_over_the_row(q, k, v, batch: AttentionBatch, *, scale: float, group, layer_index=None) -> torch.Tensor:
    return ulysses_attend(q, k, v, batch, scale=scale, group=group)


@torch.compiler.disable  # as ring_attend: else TorchDynamo compiles this frame apart, a graph of nothing
def _ring_over_the_row(q, k, v, batch: AttentionBatch, *, scale: float, group, layer_index=None) -> torch.Tensor:
    return ring_attend(q, k, v, batch, scale=scale, group=group)


def check_ulysses(*, heads: int, kv_heads: int, cp: int, tokens: int, key: str = "cp") -> None:
    """A one-line error naming ``key`` unless Ulysses can split ``heads`` query heads (GQA over ``kv_heads``) and a
    packed row of ``tokens`` tokens over ``cp`` ranks."""
    if heads % cp:
        raise ValueError(f"{key}={cp} does not divide the model's {heads} attention heads (Ulysses splits them)")
    replicated = replicated_kv_heads(kv_heads, cp)
    if heads % replicated:
        raise ValueError(
            f"{key}={cp}: the {kv_heads} key/value heads, replicated to {replicated} so that {cp} ranks can split "
            f"them, no longer divide the {heads} query heads"
        )
    if tokens % cp:
        raise ValueError(f"a packed row of {tokens} tokens does not split into {key}={cp} equal chunks; pad it")


def ulysses_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    *,
    scale: float,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Causal attention of this rank's chunk ``q`` ``[1, T / cp, heads, d]`` (``k, v`` ``[1, T / cp, kv_heads,
    d]``; chunk ``r`` of the row on group rank ``r``) over the whole row that ``batch`` describes; returns this
    chunk's output ``[1, T / cp, heads, d]``, equal to that slice of ``attend`` over the whole row."""
    cp = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_ulysses(heads=heads, kv_heads=kv_heads, cp=cp, tokens=q.shape[1] * cp)
    repeat = replicated_kv_heads(kv_heads, cp) // kv_heads
    if repeat > 1:  # each key/value head stays next to the query heads that read it
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    q, k, v = (_to_head_split(tensor, cp, group) for tensor in (q, k, v))
    out = attend(q, k, v, batch, scale=scale)
    return _to_sequence_split(out, cp, group)


def _to_head_split(tensor: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[1, T / cp, h, d]`` (a sequence chunk, every head) -> ``[1, T, h / cp, d]`` (every token, a head group)."""
    chunk, heads, dim = tensor.shape[1:]
    # Head group j goes to rank j; what arrives from rank s is sequence chunk s of this rank's head group.
    outgoing = tensor[0].reshape(chunk, cp, heads // cp, dim).transpose(0, 1).contiguous()
    arrived = all_to_all_single_autograd(outgoing.flatten(0, 1), None, None, group)
    return arrived.reshape(1, cp * chunk, heads // cp, dim)


def _to_sequence_split(tensor: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[1, T, h / cp, d]`` -> ``[1, T / cp, h, d]``: the inverse of ``_to_head_split``."""
    tokens, group_heads, dim = tensor.shape[1:]
    chunk = tokens // cp
    # Sequence chunk j goes to rank j; what arrives from rank s is head group s of this rank's chunk.
    arrived = all_to_all_single_autograd(tensor[0].contiguous(), None, None, group).reshape(cp, chunk, group_heads, dim)
    return arrived.transpose(0, 1).reshape(1, chunk, cp * group_heads, dim)


def ulysses_bytes(*, tokens: int, heads: int, kv_heads: int, head_dim: int, cp: int, dtype_bytes: int) -> float:
    """Bytes one rank sends to other ranks in one layer's forward: its chunk of q, of k and v (replicated key/value
    heads included) and of the output, ``(cp - 1) / cp`` of each bound for another rank."""
    per_token = (2 * heads + 2 * replicated_kv_heads(kv_heads, cp)) * head_dim * dtype_bytes
    return tokens / cp * per_token * (cp - 1) / cp
