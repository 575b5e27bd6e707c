"""Fused log-softmax-gather and entropy over the vocabulary, forward and backward, in one pass each.

For logits ``x`` of one token with label ``y`` at temperature ``T``, ``l = x / T`` (each logit read in its own dtype
and multiplied by ``1 / T`` in float32, so no scaled copy of the logits exists), ``lse = logsumexp(l)``,
``p = softmax(l)``:

    log_prob = l[y] - lse
    entropy  = -sum_j p_j log p_j = log s - t / s,  s = sum_j e^(l_j - m),  t = sum_j e^(l_j - m) (l_j - m)

with ``m`` the row max (the centred form avoids the cancellation of ``lse - sum_j p_j l_j`` for large logits). The
forward kernel streams each row through vocabulary blocks once, keeping ``m``, ``s`` and ``t`` online: when the
running max grows from ``m`` to ``m'`` every earlier term is scaled by ``c = e^(m - m')`` and its centred logit gains
``m - m'``, so ``s <- c s`` and ``t <- c (t + (m - m') s)``. It saves one float per token (``lse``) besides the
outputs.

Backward, with upstream gradients ``g`` (log-prob) and ``h`` (entropy), using ``d log p_y / d l_j = [j = y] - p_j``
and ``d H / d l_j = -p_j (log p_j + H)``:

    d loss / d l_j = g [j = y] - p_j (g + h (log p_j + H))

which the backward kernel evaluates block by block from the saved ``lse`` and ``H`` (``log p_j = l_j - lse``),
writing the gradient straight into a tensor of the logits' dtype. The gradient w.r.t. the unscaled logits ``x`` is
that times ``1 / T``, folded into ``g`` and ``h`` since the expression is linear in them. Neither pass materialises a
float32 ``[tokens, vocab]`` tensor. ``spmd_rlhf.models.logprob`` calls this on CUDA; vocabulary-parallel logits keep its
chunked torch path.
"""

from __future__ import annotations

import math

import torch

from spmd_rlhf.kernels.triton_support import launch_device, tl, triton, use_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MAX_BLOCK_VOCAB = 4096
"""Vocabulary entries per block: wide enough to stream at full bandwidth, small enough to stay in registers."""


def reference_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' definition in plain torch, differentiable by autograd; materialises the full log-softmax of
    ``logits / temperature``.

    Computes in float32 (float64 for float64 logits, which the tests use as ground truth)."""
    check_temperature(temperature)
    log_softmax = (logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature).log_softmax(dim=-1)
    log_probs = log_softmax.gather(-1, labels.long()[:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
    return log_probs, entropy


def check_temperature(temperature: float) -> None:
    """Log-probs are of ``softmax(logits / temperature)``: only a finite positive temperature defines one (greedy
    decoding, temperature 0, has no softmax to score against)."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature={temperature!r} must be a finite number > 0: log-probs are of softmax(logits / temperature); "
            "score greedy rollouts at temperature 1"
        )


def _check_inputs(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [tokens, vocab] with a non-empty vocabulary, got {list(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels must be [tokens={logits.shape[0]}], got {list(labels.shape)}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"logits must be float16, bfloat16 or float32, got {logits.dtype}")
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"labels must be int32 or int64 token ids, got {labels.dtype}")
    if logits.device != labels.device:
        raise ValueError(f"logits are on {logits.device} but labels on {labels.device}")
    # Rows may be strided (a slice of a longer sequence); the vocabulary blocks are loaded as contiguous runs.
    if logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous along the vocabulary (stride 1), got strides {logits.stride()}")


def _block_vocab(vocab: int) -> int:
    return min(MAX_BLOCK_VOCAB, triton.next_power_of_2(vocab))


def _num_warps(block_vocab: int) -> int:
    return 8 if block_vocab >= 2048 else 4


class _FusedLogProbEntropy(torch.autograd.Function):
    """Log-probs and entropies ``[tokens]`` float32 of ``logits`` ``[tokens, vocab]``; gradients w.r.t. ``logits``."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, vocab = logits.shape
        log_probs, entropy, logsumexp = (
            torch.empty(tokens, dtype=torch.float32, device=logits.device) for _ in range(3)
        )
        if tokens > 0:
            block_vocab = _block_vocab(vocab)
            with launch_device(logits.device):
                _forward_kernel[(tokens,)](
                    log_probs,
                    entropy,
                    logsumexp,
                    logits,
                    labels,
                    1.0 / temperature,
                    vocab,
                    logits.stride(0),
                    labels.stride(0),
                    BLOCK_VOCAB=block_vocab,
                    num_warps=_num_warps(block_vocab),
                )
        ctx.save_for_backward(logits, labels, logsumexp, entropy)
        ctx.temperature = temperature
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, logsumexp, entropy = ctx.saved_tensors
        tokens, vocab = logits.shape
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        if tokens > 0:
            block_vocab = _block_vocab(vocab)
            # No reduction is needed, so every (token, vocabulary block) pair is its own program.
            with launch_device(logits.device):
                _backward_kernel[(tokens, triton.cdiv(vocab, block_vocab))](
                    grad_logits,
                    logits,
                    labels,
                    logsumexp,
                    entropy,
                    grad_log_probs,
                    grad_entropy,
                    1.0 / ctx.temperature,
                    vocab,
                    grad_logits.stride(0),
                    logits.stride(0),
                    labels.stride(0),
                    grad_log_probs.stride(0),
                    grad_entropy.stride(0),
                    BLOCK_VOCAB=block_vocab,
                    num_warps=_num_warps(block_vocab),
                )
        return grad_logits, None, None


def fused_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[labels]`` and the entropy of ``softmax(logits / temperature)``, both
    float32 ``[tokens]`` and differentiable w.r.t. ``logits`` ``[tokens, vocab]`` (float16, bfloat16 or float32;
    ``labels`` int ``[tokens]``). The kernels scale each logit in float32 as they read it, so the caller passes the
    logits unscaled and in their own dtype rather than a float32 ``logits / temperature`` copy.

    ``backend``: ``auto`` (the Triton kernels on CUDA when triton is installed, else the torch reference),
    ``triton`` or ``torch``. The reference materialises the float32 log-softmax; the memory-light torch path for large
    inputs is ``spmd_rlhf.models.logprob``, which calls this function where the kernels apply. On the Triton path a
    label outside ``[0, vocab)`` yields a NaN log-prob (checking the range on the host would wait for the device).
    """
    _check_inputs(logits, labels)
    check_temperature(temperature)
    if not use_triton(logits.device, backend):
        return reference_log_probs_and_entropy(logits, labels, temperature=temperature)
    return _FusedLogProbEntropy.apply(logits, labels, float(temperature))


if triton is not None:

    @triton.jit
    def _forward_kernel(
        log_probs_ptr,
        entropy_ptr,
        logsumexp_ptr,
        logits_ptr,
        labels_ptr,
        inverse_temperature,
        vocab,
        stride_logits_row,
        stride_labels,
        BLOCK_VOCAB: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_logits_row
        running_max = float("-inf")
        running_sum = 0.0
        centred_sum = 0.0
        for start in range(0, vocab, BLOCK_VOCAB):
            columns = start + tl.arange(0, BLOCK_VOCAB)
            mask = columns < vocab
            logits = tl.load(row_ptr + columns, mask=mask, other=float("-inf")).to(tl.float32) * inverse_temperature
            new_max = tl.maximum(running_max, tl.max(logits, axis=0))
            correction = tl.exp(running_max - new_max)
            centred = logits - new_max
            exps = tl.exp(centred)
            # Before the first block running_sum is 0 and running_max -inf: their product would be NaN, not 0.
            shift = tl.where(running_sum > 0, (running_max - new_max) * running_sum, 0.0)
            block_centred_sum = tl.sum(tl.where(mask, exps * centred, 0.0), axis=0)
            centred_sum = correction * (centred_sum + shift) + block_centred_sum
            running_sum = correction * running_sum + tl.sum(exps, axis=0)
            running_max = new_max
        log_sum = tl.log(running_sum)
        logsumexp = running_max + log_sum
        label = tl.load(labels_ptr + row * stride_labels)
        inside = (label >= 0) & (label < vocab)
        picked = tl.load(row_ptr + label, mask=inside, other=float("nan")).to(tl.float32) * inverse_temperature
        tl.store(log_probs_ptr + row, picked - logsumexp)
        tl.store(entropy_ptr + row, log_sum - centred_sum / running_sum)
        tl.store(logsumexp_ptr + row, logsumexp)

    @triton.jit
    def _backward_kernel(
        grad_logits_ptr,
        logits_ptr,
        labels_ptr,
        logsumexp_ptr,
        entropy_ptr,
        grad_log_probs_ptr,
        grad_entropy_ptr,
        inverse_temperature,
        vocab,
        stride_grad_row,
        stride_logits_row,
        stride_labels,
        stride_grad_log_probs,
        stride_grad_entropy,
        BLOCK_VOCAB: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
        mask = columns < vocab
        logits = tl.load(logits_ptr + row * stride_logits_row + columns, mask=mask, other=0.0).to(tl.float32)
        logits *= inverse_temperature
        log_probs = logits - tl.load(logsumexp_ptr + row)
        probs = tl.exp(log_probs)
        # d l / d x = 1 / T, and the gradient below is linear in the upstream gradients: scale those once per row.
        grad_log_prob = tl.load(grad_log_probs_ptr + row * stride_grad_log_probs).to(tl.float32) * inverse_temperature
        grad_entropy = tl.load(grad_entropy_ptr + row * stride_grad_entropy).to(tl.float32) * inverse_temperature
        entropy = tl.load(entropy_ptr + row)
        grad = -probs * (grad_log_prob + grad_entropy * (log_probs + entropy))
        label = tl.load(labels_ptr + row * stride_labels)
        grad = tl.where(columns == label, grad + grad_log_prob, grad)
        grad_row_ptr = grad_logits_ptr + row * stride_grad_row
        tl.store(grad_row_ptr + columns, grad.to(grad_logits_ptr.dtype.element_ty), mask=mask)
