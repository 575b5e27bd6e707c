"""Per-token log-probabilities and entropies from logits, in chunks of rows.

A float32 ``[tokens, vocab]`` softmax is never materialised, neither in the forward nor in the backward pass: each
autograd function keeps only the logits (in their own dtype) and one float per token, and recomputes the softmax of
one chunk at a time when gradients are needed.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 64 * 1024**2
"""Float32 bytes of one chunk of logits; rows per chunk = this / (vocab * 4), so big vocabularies get short chunks."""


class _ChunkedLogProb(torch.autograd.Function):
    """``log p(label) = logit[label] - logsumexp(logits)``; gradient ``g * (onehot(label) - softmax)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], chunk):
            rows = logits[start : start + chunk].float()
            lse[start : start + chunk] = torch.logsumexp(rows, dim=-1)
            picked = rows.gather(-1, labels[start : start + chunk, None]).squeeze(-1)
            out[start : start + chunk] = picked - lse[start : start + chunk]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = start + ctx.chunk
            g = grad_out[start:end, None].float()
            chunk_grad = (logits[start:end].float() - lse[start:end, None]).exp_().mul_(-g)
            chunk_grad.scatter_add_(-1, labels[start:end, None], g)
            grad[start:end] = chunk_grad
        return grad, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """``H = logsumexp(l) - sum_i p_i l_i``; gradient ``dH/dl_j = g * p_j (sum_i p_i l_i - l_j)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk: int) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for start in range(0, logits.shape[0], chunk):
            rows = logits[start : start + chunk].float()
            lse[start : start + chunk] = torch.logsumexp(rows, dim=-1)
            probs = (rows - lse[start : start + chunk, None]).exp_()
            out[start : start + chunk] = lse[start : start + chunk] - torch.linalg.vecdot(probs, rows)
        ctx.save_for_backward(logits, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = start + ctx.chunk
            rows = logits[start:end].float()
            probs = (rows - lse[start:end, None]).exp_()
            mean_logit = torch.linalg.vecdot(probs, rows)[:, None]
            # rows may alias the saved logits (float32 input), so it is never modified in place.
            grad[start:end] = (mean_logit - rows).mul_(probs).mul_(grad_out[start:end, None].float())
        return grad, None


def _flatten(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1])


def _rows_per_chunk(logits: torch.Tensor, chunk_tokens: int | None) -> int:
    return chunk_tokens or max(1, DEFAULT_CHUNK_BYTES // (4 * logits.shape[-1]))


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """``log softmax(logits)[..., labels]`` in float32, shape ``labels.shape``; differentiable w.r.t. ``logits``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {list(logits.shape)} and labels {list(labels.shape)} disagree on the leading dims")
    out = _ChunkedLogProb.apply(_flatten(logits), labels.reshape(-1).long(), _rows_per_chunk(logits, chunk_tokens))
    return out.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits)`` in float32, shape ``logits.shape[:-1]``; differentiable."""
    return _ChunkedEntropy.apply(_flatten(logits), _rows_per_chunk(logits, chunk_tokens)).view(logits.shape[:-1])
