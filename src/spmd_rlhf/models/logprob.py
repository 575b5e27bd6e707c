"""Per-token log-probabilities and entropies from logits, in chunks of rows, optionally vocab-parallel.

A float32 ``[tokens, vocab]`` softmax is never materialised, neither in the forward nor in the backward pass: each
autograd function keeps only the logits (in their own dtype) and one float per token, and recomputes the softmax of
one chunk at a time when gradients are needed.

Vocab-parallel (tensor-parallel LM head): each rank holds the logits of its slice of the vocabulary
``[vocab_start, vocab_start + local_vocab)``; the log-sum-exp, the picked logit and the mean logit are all-reduced
over ``group`` (three small per-token reductions), so the full-vocabulary logits are never gathered. The backward
pass needs no communication: each rank's gradient is that of its own slice.

Every function takes a ``temperature`` and computes the statistics of ``softmax(logits / temperature)``: each chunk
(or, in the kernels, each block of a row) is scaled after its float32 upcast, so callers pass the logits unscaled and
in their own dtype, and neither a float32 nor a scaled ``[tokens, vocab]`` copy of them is ever made. Gradients are
w.r.t. the unscaled logits (the chain rule's ``1 / temperature`` included).

On CUDA with Triton installed, full-vocabulary logits (no ``group``) take the fused kernels of
``spmd_rlhf.kernels.fused_logprob`` instead: one streaming pass per token computes log-prob and entropy together, and
one pass writes their gradient, with no row chunking needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rlhf.kernels.fused_logprob import (
    SUPPORTED_DTYPES as FUSED_DTYPES,
)
from spmd_rlhf.kernels.fused_logprob import (
    check_temperature,
    fused_log_probs_and_entropy,
)
from spmd_rlhf.kernels.triton_support import use_triton

DEFAULT_CHUNK_BYTES = 64 * 1024**2
"""Float32 bytes of one chunk of logits; rows per chunk = this / (vocab * 4), so big vocabularies get short chunks."""


def _all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _logsumexp(rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``logsumexp`` over the last dim, whose slices are spread over ``group`` when given."""
    if group is None:
        return torch.logsumexp(rows, dim=-1)
    peak = _all_reduce(rows.max(dim=-1).values, group, dist.ReduceOp.MAX)
    total = _all_reduce((rows - peak[:, None]).exp().sum(dim=-1), group)
    return peak + total.log()


def _scaled_rows(logits: torch.Tensor, start: int, end: int, temperature: float) -> torch.Tensor:
    """Rows ``[start, end)`` of ``logits / temperature`` in float32; the only float32 copy of logits that exists, one
    chunk at a time. It may alias ``logits`` (float32 input at temperature 1), so callers never modify it in place."""
    rows = logits[start:end].float()
    return rows if temperature == 1.0 else rows / temperature


def _local_labels(labels: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels as indices into this rank's vocabulary slice (clamped), and whether each label falls in it."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), inside


class _ChunkedLogProb(torch.autograd.Function):
    """With ``l = logits / T``: ``log p(label) = l[label] - logsumexp(l)``; gradient w.r.t. ``logits``
    ``(g / T) * (onehot(label) - softmax(l))``."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int, group, vocab_start: int, temperature: float
    ) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        local_labels, inside = _local_labels(labels, vocab_start, logits.shape[-1])
        for start in range(0, logits.shape[0], chunk):
            rows = _scaled_rows(logits, start, start + chunk, temperature)
            lse[start : start + chunk] = _logsumexp(rows, group)
            picked = rows.gather(-1, local_labels[start : start + chunk, None]).squeeze(-1)
            if group is not None:
                picked = _all_reduce(picked * inside[start : start + chunk], group)
            out[start : start + chunk] = picked - lse[start : start + chunk]
        ctx.save_for_backward(logits, local_labels, inside, lse)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, local_labels, inside, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = start + ctx.chunk
            g = grad_out[start:end, None].float() / ctx.temperature
            chunk_grad = (_scaled_rows(logits, start, end, ctx.temperature) - lse[start:end, None]).exp_().mul_(-g)
            chunk_grad.scatter_add_(-1, local_labels[start:end, None], g * inside[start:end, None])
            grad[start:end] = chunk_grad
        return grad, None, None, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """With ``l = logits / T``: ``H = logsumexp(l) - sum_i p_i l_i``; gradient w.r.t. ``logits``
    ``(g / T) * p_j (sum_i p_i l_i - l_j)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk: int, group, temperature: float) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        mean_logit = torch.empty_like(out)
        for start in range(0, logits.shape[0], chunk):
            rows = _scaled_rows(logits, start, start + chunk, temperature)
            lse[start : start + chunk] = _logsumexp(rows, group)
            probs = (rows - lse[start : start + chunk, None]).exp_()
            mean_logit[start : start + chunk] = _all_reduce(torch.linalg.vecdot(probs, rows), group)
        out = lse - mean_logit
        ctx.save_for_backward(logits, lse, mean_logit)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, mean_logit = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = start + ctx.chunk
            rows = _scaled_rows(logits, start, end, ctx.temperature)
            probs = (rows - lse[start:end, None]).exp_()
            g = grad_out[start:end, None].float() / ctx.temperature
            grad[start:end] = (mean_logit[start:end, None] - rows).mul_(probs).mul_(g)
        return grad, None, None, None


def _flatten(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1])


def rows_per_chunk(local_vocab: int) -> int:
    """Rows per float32 chunk of logits over ``local_vocab`` entries (this rank's vocabulary slice) by default."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * local_vocab))


def _rows_per_chunk(logits: torch.Tensor, chunk_tokens: int | None) -> int:
    return chunk_tokens or rows_per_chunk(logits.shape[-1])


def _fused_applies(logits: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """The Triton kernels serve full-vocabulary logits on CUDA; a vocabulary slice (``group``) keeps the torch path,
    whose per-token statistics are all-reduced over the group."""
    return (
        group is None and logits.dtype in FUSED_DTYPES and logits.stride(-1) == 1 and use_triton(logits.device, "auto")
    )


def _fused(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs, entropy = fused_log_probs_and_entropy(_flatten(logits), labels.reshape(-1), temperature=temperature)
    return log_probs.view(labels.shape), entropy.view(labels.shape)


def _check_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {list(logits.shape)} and labels {list(labels.shape)} disagree on the leading dims")


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[..., labels]`` in float32, shape ``labels.shape``; differentiable w.r.t.
    ``logits``. Pass the logits unscaled and in their own dtype: the scale is applied to float32 chunks.

    With ``group``, ``logits`` are this rank's vocabulary slice starting at token id ``vocab_start`` and every rank
    of ``group`` must call this with the same labels and chunking. ``chunk_tokens`` (rows per chunk of the torch path)
    does not apply to the fused CUDA kernels, which need no chunks."""
    _check_labels(logits, labels)
    check_temperature(temperature)
    if _fused_applies(logits, group):
        return _fused(logits, labels, temperature)[0]
    chunk = _rows_per_chunk(logits, chunk_tokens)
    out = _ChunkedLogProb.apply(_flatten(logits), labels.reshape(-1).long(), chunk, group, vocab_start, temperature)
    return out.view(labels.shape)


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Entropy ``-sum p log p`` of ``p = softmax(logits / temperature)`` in float32, shape ``logits.shape[:-1]``;
    differentiable. With ``group``, ``logits`` are this rank's vocabulary slice (see ``log_probs_from_logits``)."""
    check_temperature(temperature)
    if _fused_applies(logits, group):
        # The fused kernel reads a label per token; entropy needs none, so token 0 serves and its log-prob is dropped.
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        return _fused(logits, labels, temperature)[1]
    chunk = _rows_per_chunk(logits, chunk_tokens)
    return _ChunkedEntropy.apply(_flatten(logits), chunk, group, temperature).view(logits.shape[:-1])


def log_probs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_probs_from_logits(...), entropy_from_logits(...))`` of the same logits, for losses with an entropy
    term: on the fused CUDA path one read of the logits computes both and one pass writes their summed gradient."""
    _check_labels(logits, labels)
    check_temperature(temperature)
    if _fused_applies(logits, group):
        return _fused(logits, labels, temperature)
    log_probs = log_probs_from_logits(
        logits, labels, temperature=temperature, chunk_tokens=chunk_tokens, group=group, vocab_start=vocab_start
    )
    return log_probs, entropy_from_logits(logits, temperature=temperature, chunk_tokens=chunk_tokens, group=group)
