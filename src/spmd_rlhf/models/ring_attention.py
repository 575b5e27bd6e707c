"""Context parallelism, ring style: a packed row's tokens split over the ``cp`` ranks of a group in load-balanced
(zig-zag) chunks; each rank keeps its queries and passes its keys and values around the ring, attending to each
arriving block with an online softmax, so no rank ever holds more than two chunks' keys and values and the degree is
not bounded by the head count (Ulysses' is).

Zig-zag: the row (padded to a multiple of ``2 cp`` tokens) is cut into ``2 cp`` equal chunks and rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r`` (``zigzag_ranges``), so under the causal mask every rank has the same work: an
early chunk sees little of the row, its partner late chunk nearly all of it. A block whose keys all lie after a query
range is skipped, decided from the ranges alone (host integers), so no rank waits on the device for it.

Masking over a packed row: query token ``i`` may read key ``j`` when ``j <= i`` in the row and both lie in the same
packed sequence (``sequence_ids`` from ``cu_seqlens``). Grouped-query attention reads each key/value head once per
group of query heads: no replication, whatever ``cp`` and the head counts.

The forward keeps only this rank's ``q``, ``k``, ``v``, the output and its log-sum-exp; the backward passes the keys and
values around the ring again (each shift started before the block in hand is computed) with their gradients one exchange
behind them, and after the last block one more exchange brings each block's key/value gradients home. Scores are
computed one query tile (``query_tile`` tokens) against one arriving chunk at a time in float32, so memory beyond the
inputs is ``heads x query_tile x chunk``. Each key/value exchange is started before the block in hand is computed
(``batch_isend_irecv``), so on GPUs it overlaps the compute.

Bytes each rank sends per layer: its keys and values ``cp - 1`` times in the forward (``ring_bytes``), and twice
that (keys, values and their gradients) plus one more step in the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rlhf.models.attention import AttentionBatch

QUERY_TILE = 1024
"""Query tokens whose float32 scores against one chunk are materialised at a time."""


def zigzag_ranges(rank: int, cp: int, tokens: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, end)`` row ranges rank ``rank`` holds of a row of ``tokens`` tokens (a multiple of
    ``2 cp``), in the order its chunk lays them: chunk ``rank``, then chunk ``2 cp - 1 - rank``."""
    size = tokens // (2 * cp)
    late = 2 * cp - 1 - rank
    return (rank * size, (rank + 1) * size), (late * size, (late + 1) * size)


def zigzag_positions(rank: int, cp: int, tokens: int) -> torch.Tensor:
    """The row positions of rank ``rank``'s chunk, in its order ``[tokens / cp]``."""
    return torch.cat([torch.arange(start, end) for start, end in zigzag_ranges(rank, cp, tokens)])


def ring_bytes(*, tokens: int, kv_heads: int, head_dim: int, cp: int, dtype_bytes: int) -> float:
    """Bytes one rank sends in one layer's forward: its chunk's keys and values, ``cp - 1`` times."""
    return tokens / cp * 2 * kv_heads * head_dim * dtype_bytes * (cp - 1)


@torch.compiler.disable
def ring_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    *,
    scale: float,
    group: dist.ProcessGroup,
    query_tile: int = QUERY_TILE,
) -> torch.Tensor:
    """Causal attention of this rank's zig-zag chunk ``q`` ``[1, T / cp, heads, d]`` (``k, v`` ``[1, T / cp,
    kv_heads, d]``) over the packed row of ``T`` tokens that ``batch.cu_seqlens`` describes; returns this chunk's
    output ``[1, T / cp, heads, d]``, equal to those positions of ``attend`` over the whole row. Never traced by
    TorchDynamo (its point-to-point exchanges do not compile): a compiled block breaks its graph here and compiles
    the work around it (``parallelize.compile_block``)."""
    if batch.cu_seqlens is None:
        raise ValueError("ring attention runs over one packed row: the attention batch needs cu_seqlens")
    cp = dist.get_world_size(group)
    tokens = q.shape[1] * cp
    check_ring(cp=cp, tokens=tokens)
    sequence_ids = torch.searchsorted(
        batch.cu_seqlens.to(q.device), torch.arange(tokens, device=q.device, dtype=torch.int32), right=True
    )
    return _RingAttention.apply(q, k, v, sequence_ids, scale, group, query_tile)


class _Ring:
    """This rank's place in the ring: neighbours by global rank, and which rank's chunk it holds at each step."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.cp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def source(self, step: int) -> int:
        """The group rank whose keys and values this rank holds at ``step`` (step 0: its own)."""
        return (self.rank - step) % self.cp

    def start_shift(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send ``tensor`` to the next rank and receive the previous rank's into a new buffer; returns the buffer
        and the requests to wait on."""
        arriving = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self.next, self.group),
                dist.P2POp(dist.irecv, arriving, self.previous, self.group),
            ]
        )
        return arriving, requests


def _pairs(ring: _Ring, step: int, tokens: int):
    """The (query slice, key slice, query row start, key row start) pairs of this rank's chunk against the chunk it
    holds at ``step`` where some key may be read (a key range wholly after a query range is skipped)."""
    local = zigzag_ranges(ring.rank, ring.cp, tokens)
    remote = zigzag_ranges(ring.source(step), ring.cp, tokens)
    size = tokens // (2 * ring.cp)
    for qi, (q_start, q_end) in enumerate(local):
        for ki, (k_start, _) in enumerate(remote):
            if k_start < q_end:
                yield slice(qi * size, (qi + 1) * size), slice(ki * size, (ki + 1) * size), q_start, k_start


def _scores(q, k, sequence_ids, q_start, k_start, scale):
    """float32 scores ``[kv_heads, group, q_tokens, k_tokens]`` of grouped queries ``[q_tokens, kv_heads, group, d]``
    against keys ``[k_tokens, kv_heads, d]``, -inf where the causal or the packed-sequence mask forbids."""
    q_rows = torch.arange(q.shape[0], device=q.device) + q_start
    k_rows = torch.arange(k.shape[0], device=q.device) + k_start
    allowed = (k_rows[None, :] <= q_rows[:, None]) & (sequence_ids[k_rows][None, :] == sequence_ids[q_rows][:, None])
    scores = torch.einsum("qhgd,khd->hgqk", q.float(), k.float()) * scale
    return scores.masked_fill(~allowed, float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sequence_ids, scale, group, query_tile):
        ring = _Ring(group)
        _, chunk, heads, dim = q.shape
        kv_heads = k.shape[2]
        tokens = chunk * ring.cp
        grouped = q[0].reshape(chunk, kv_heads, heads // kv_heads, dim)
        # Running max, sum and unnormalised output per query head and token, float32.
        running_max = q.new_full((kv_heads, heads // kv_heads, chunk), float("-inf"), dtype=torch.float32)
        running_sum = torch.zeros_like(running_max)
        acc = q.new_zeros((kv_heads, heads // kv_heads, chunk, dim), dtype=torch.float32)
        held = torch.stack([k[0], v[0]])
        for step in range(ring.cp):
            if step + 1 < ring.cp:
                arriving, requests = ring.start_shift(held)
            for q_slice, k_slice, q_start, k_start in _pairs(ring, step, tokens):
                keys, values = held[0, k_slice], held[1, k_slice]
                for tile in range(q_slice.start, q_slice.stop, query_tile):
                    rows = slice(tile, min(tile + query_tile, q_slice.stop))
                    scores = _scores(grouped[rows], keys, sequence_ids, q_start + tile - q_slice.start, k_start, scale)
                    block_max = scores.amax(-1)
                    new_max = torch.maximum(running_max[..., rows], block_max)
                    safe = torch.where(torch.isinf(new_max), 0.0, new_max)  # rows with nothing to read yet
                    correction = torch.exp(running_max[..., rows] - safe)
                    probs = torch.exp(scores - safe[..., None])
                    running_sum[..., rows] = running_sum[..., rows] * correction + probs.sum(-1)
                    acc[..., rows, :] = acc[..., rows, :] * correction[..., None] + torch.einsum(
                        "hgqk,khd->hgqd", probs, values.float()
                    )
                    running_max[..., rows] = new_max
            if step + 1 < ring.cp:
                for request in requests:
                    request.wait()
                held = arriving
        out = acc / torch.where(running_sum > 0, running_sum, 1.0)[..., None]
        lse = torch.where(running_sum > 0, running_max + torch.log(running_sum), float("-inf"))
        out = out.permute(2, 0, 1, 3).reshape(1, chunk, heads, dim).to(q.dtype)
        ctx.save_for_backward(q, k, v, sequence_ids, out, lse)
        ctx.scale, ctx.group, ctx.query_tile = scale, group, query_tile
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sequence_ids, out, lse = ctx.saved_tensors
        scale, query_tile = ctx.scale, ctx.query_tile
        ring = _Ring(ctx.group)
        _, chunk, heads, dim = q.shape
        kv_heads = k.shape[2]
        group_size = heads // kv_heads
        tokens = chunk * ring.cp
        grouped = q[0].reshape(chunk, kv_heads, group_size, dim)
        grad = grad_out[0].reshape(chunk, kv_heads, group_size, dim).float()
        # D = rowsum(dO * O), per query head and token: the softmax's backward term.
        delta = (grad * out[0].reshape(chunk, kv_heads, group_size, dim).float()).sum(-1).permute(1, 2, 0)
        grad_q = torch.zeros(chunk, kv_heads, group_size, dim, dtype=torch.float32, device=q.device)
        # Keys and values travel ahead (their next shift starts before the block in hand is computed); their
        # gradients, float32 so the sums keep their digits, follow once the block has added to them.
        held = torch.stack([k[0], v[0]])
        grads = torch.zeros((2, *k.shape[1:]), dtype=torch.float32, device=k.device)
        for step in range(ring.cp):
            if step + 1 < ring.cp:
                arriving, requests = ring.start_shift(held)
            keys_values = held.float()
            for q_slice, k_slice, q_start, k_start in _pairs(ring, step, tokens):
                keys, values = keys_values[0, k_slice], keys_values[1, k_slice]
                for tile in range(q_slice.start, q_slice.stop, query_tile):
                    rows = slice(tile, min(tile + query_tile, q_slice.stop))
                    scores = _scores(grouped[rows], keys, sequence_ids, q_start + tile - q_slice.start, k_start, scale)
                    row_lse = lse[..., rows]
                    probs = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
                    grad_tile = grad[rows]  # [q, kv_heads, group, d]
                    grads[1, k_slice] += torch.einsum("hgqk,qhgd->khd", probs, grad_tile)
                    grad_probs = torch.einsum("qhgd,khd->hgqk", grad_tile, values)
                    grad_scores = probs * (grad_probs - delta[..., rows, None]) * scale
                    grad_q[rows] += torch.einsum("hgqk,khd->qhgd", grad_scores, keys)
                    grads[0, k_slice] += torch.einsum("hgqk,qhgd->khd", grad_scores, grouped[rows].float())
            # The gradients go where the keys and values went; after the last block this step brings them home.
            grads_arriving, grad_requests = ring.start_shift(grads)
            for request in grad_requests + (requests if step + 1 < ring.cp else []):
                request.wait()
            grads = grads_arriving
            if step + 1 < ring.cp:
                held = arriving
        grad_q = grad_q.reshape(1, chunk, heads, dim).to(q.dtype)
        return grad_q, grads[0][None].to(k.dtype), grads[1][None].to(v.dtype), None, None, None, None


def check_ring(*, cp: int, tokens: int, key: str = "cp") -> None:
    """A one-line error naming ``key`` unless a packed row of ``tokens`` tokens splits into ``2 cp`` chunks."""
    if tokens % (2 * cp):
        raise ValueError(f"a packed row of {tokens} tokens does not split into 2 x {key}={cp} zig-zag chunks; pad it")
