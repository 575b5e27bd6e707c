"""Fused log-prob / entropy: the Triton kernels' values and gradients against the torch reference (on CUDA, and on
CPU under Triton's interpreter), the reference against the chunked torch path, the wrapper's input checks, and the
dispatch from ``spmd_rlhf.models.logprob``."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import (
    LOG_PROB_INTERPRETER_CASES,
    RELATIVE_TOLERANCE,
    LogProbCase,
    check_log_probs_and_entropy,
    check_out_of_range_label_gives_nan,
    interpreter_unusable_reason,
    run_under_interpreter,
)

import spmd_rlhf.models.logprob as logprob
from spmd_rlhf.kernels.fused_logprob import fused_log_probs_and_entropy, reference_log_probs_and_entropy
from spmd_rlhf.kernels.triton_support import triton_available
from spmd_rlhf.models import entropy_from_logits, log_probs_and_entropy_from_logits, log_probs_from_logits

needs_cuda_and_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA device and triton"
)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_reference_matches_the_chunked_torch_path_in_values_and_gradients(temperature):
    logits = (torch.randn(9, 70) * 3).requires_grad_()
    labels = torch.randint(0, 70, (9,))
    weights = torch.randn(2, 9)
    log_probs, entropy = reference_log_probs_and_entropy(logits, labels, temperature=temperature)
    (grad,) = torch.autograd.grad((log_probs * weights[0] + entropy * weights[1]).sum(), logits)
    chunked_log_probs = log_probs_from_logits(logits, labels, temperature=temperature, chunk_tokens=4)
    chunked_entropy = entropy_from_logits(logits, temperature=temperature, chunk_tokens=4)
    (chunked_grad,) = torch.autograd.grad((chunked_log_probs * weights[0] + chunked_entropy * weights[1]).sum(), logits)
    torch.testing.assert_close(log_probs, chunked_log_probs, atol=1e-5, rtol=1e-5)
    # The chunked path's entropy, logsumexp − Σ p·l, cancels in float32 on the sharp rows of T < 1 (the reference
    # computes −Σ p log p): over 3,000 random draws up to 2.4e-5 in the entropy and 7e-5 in its gradient.
    torch.testing.assert_close(entropy, chunked_entropy, atol=6e-5, rtol=1e-5)
    torch.testing.assert_close(grad, chunked_grad, atol=2.5e-4, rtol=1e-5)


def test_cpu_falls_back_to_the_reference():
    logits, labels = torch.randn(5, 33).bfloat16(), torch.randint(0, 33, (5,))
    fused = fused_log_probs_and_entropy(logits, labels, temperature=0.7)
    for actual, expected in zip(fused, reference_log_probs_and_entropy(logits, labels, temperature=0.7)):
        assert torch.equal(actual, expected)


def test_log_probs_and_entropy_together_equal_the_two_functions():
    logits, labels = torch.randn(2, 6, 40).requires_grad_(), torch.randint(0, 40, (2, 6))
    log_probs, entropy = log_probs_and_entropy_from_logits(logits, labels, chunk_tokens=5)
    torch.testing.assert_close(log_probs, log_probs_from_logits(logits, labels), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, entropy_from_logits(logits), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="disagree on the leading dims"):
        log_probs_and_entropy_from_logits(logits, labels[:, :5])


def test_models_logprob_sends_full_vocabulary_logits_to_the_kernel_when_triton_applies(monkeypatch):
    calls = []

    def recording_kernel(logits, labels, *, temperature):
        calls.append((logits.shape, labels.tolist(), temperature))
        return fused_log_probs_and_entropy(logits, labels, temperature=temperature, backend="torch")

    logits, labels = torch.randn(2, 3, 20), torch.randint(0, 20, (2, 3))
    expected = log_probs_and_entropy_from_logits(logits, labels, temperature=0.8)
    monkeypatch.setattr(logprob, "use_triton", lambda device, backend: True)
    monkeypatch.setattr(logprob, "fused_log_probs_and_entropy", recording_kernel)

    both = log_probs_and_entropy_from_logits(logits, labels, temperature=0.8)
    log_probs = log_probs_from_logits(logits, labels, temperature=0.8)
    entropy = entropy_from_logits(logits, temperature=0.8)
    for actual, wanted in (
        (both[0], expected[0]),
        (both[1], expected[1]),
        (log_probs, expected[0]),
        (entropy, expected[1]),
    ):
        assert actual.shape == (2, 3)
        torch.testing.assert_close(actual, wanted, atol=1e-6, rtol=1e-6)
    flat_labels = labels.reshape(-1).tolist()
    assert calls == [((6, 20), flat_labels, 0.8), ((6, 20), flat_labels, 0.8), ((6, 20), [0] * 6, 0.8)]
    log_probs_from_logits(logits.double(), labels)
    assert len(calls) == 3, "float64 logits have no kernel and keep the chunked path"
    assert not logprob._fused_applies(logits, group=object()), "a vocabulary slice keeps the all-reducing torch path"


@pytest.mark.parametrize(
    "logits,labels,message",
    [
        (torch.randn(4), torch.zeros(4, dtype=torch.long), "logits must be \\[tokens, vocab\\]"),
        (torch.randn(4, 0), torch.zeros(4, dtype=torch.long), "non-empty vocabulary"),
        (torch.randn(4, 9), torch.zeros(3, dtype=torch.long), "labels must be \\[tokens=4\\]"),
        (torch.randn(4, 9).double(), torch.zeros(4, dtype=torch.long), "float16, bfloat16 or float32"),
        (torch.randn(4, 9), torch.zeros(4), "labels must be int32 or int64"),
        (torch.randn(4, 9), torch.zeros(4, dtype=torch.long, device="meta"), "logits are on cpu but labels on meta"),
        (torch.randn(9, 4).t(), torch.zeros(4, dtype=torch.long), "contiguous along the vocabulary"),
    ],
)
def test_bad_inputs_are_named(logits, labels, message):
    with pytest.raises(ValueError, match=message):
        fused_log_probs_and_entropy(logits, labels)


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("inf"), float("nan")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_temperature_that_defines_no_softmax_is_named(temperature, backend):
    # Checked before any backend runs, so the Triton backend raises the same error on a CPU tensor.
    with pytest.raises(ValueError, match="temperature=.* must be a finite number > 0"):
        logits, labels = torch.randn(3, 9), torch.zeros(3, dtype=torch.long)
        fused_log_probs_and_entropy(logits, labels, temperature=temperature, backend=backend)


@pytest.mark.skipif(interpreter_unusable_reason() is not None, reason=str(interpreter_unusable_reason()))
def test_kernels_match_the_reference_under_the_triton_interpreter():
    passed = run_under_interpreter("fused_logprob")
    assert len(passed) == len(LOG_PROB_INTERPRETER_CASES) * len(RELATIVE_TOLERANCE) + 1, passed


CUDA_CASES = [
    LogProbCase(tokens=300, vocab=151936),
    LogProbCase(tokens=300, vocab=151936, temperature=0.6),
    LogProbCase(tokens=1000, vocab=32000, strided_rows=True, temperature=1.7),
    LogProbCase(tokens=7, vocab=50, int32_labels=True),
]


@needs_cuda_and_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_cuda_kernels_match_the_reference(case, dtype):
    check_log_probs_and_entropy(case, dtype, "cuda", "auto")


@needs_cuda_and_triton
@pytest.mark.gpu
def test_cuda_out_of_range_label_gives_nan():
    check_out_of_range_label_gives_nan("cuda")


@needs_cuda_and_triton
@pytest.mark.gpu
def test_cuda_forward_and_backward_allocate_no_float32_table():
    tokens, vocab = 2048, 65536
    logits = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    # At a temperature other than 1, as the actor calls it: the scale must not bring back a float32 copy either.
    log_probs, entropy = log_probs_and_entropy_from_logits(logits, labels, temperature=0.7)
    (log_probs.sum() + entropy.sum()).backward()
    extra = torch.cuda.max_memory_allocated() - before
    # The gradient itself is one bfloat16 table; a float32 softmax anywhere would add two more of that size.
    assert extra < 1.5 * logits.numel() * logits.element_size(), f"{extra / 2**20:.0f} MiB above the logits"
