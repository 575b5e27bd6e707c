"""Chunked log-prob / entropy: equal to the plain formulas (values and gradients) at any temperature, also with the
vocabulary split over ranks, and light on memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.models import entropy_from_logits, log_probs_and_entropy_from_logits, log_probs_from_logits


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_tokens", [None, 1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_reference(chunk_tokens, dtype, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 50, generator=generator) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 11), generator=generator)
    weights = torch.randn(3, 11, generator=generator)

    log_probs = log_probs_from_logits(logits, labels, temperature=temperature, chunk_tokens=chunk_tokens)
    entropy = entropy_from_logits(logits, temperature=temperature, chunk_tokens=chunk_tokens)
    (grad,) = torch.autograd.grad((log_probs * weights).sum() + (entropy * weights).sum(), logits)

    # What the worker computed before the temperature moved inside: a float32 copy of the logits, scaled.
    reference_logits = logits.detach().float().requires_grad_()
    log_softmax = (reference_logits / temperature).log_softmax(-1)
    reference_log_probs = log_softmax.gather(-1, labels[..., None]).squeeze(-1)
    reference_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (reference_grad,) = torch.autograd.grad(
        (reference_log_probs * weights).sum() + (reference_entropy * weights).sum(), reference_logits
    )
    assert log_probs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(log_probs, reference_log_probs, atol=1e-5, rtol=1e-5)
    # The torch path's entropy is logsumexp(l) - sum p l, two numbers of about max(l) whose float32 difference loses
    # ~1e-5 on the sharp rows a temperature below 1 makes; a float32 log-softmax reference does not.
    torch.testing.assert_close(entropy, reference_entropy, atol=3e-5, rtol=1e-5)
    assert grad.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad.float(), reference_grad, atol=tolerance, rtol=tolerance)


def test_temperature_changes_the_result_and_the_pair_function_agrees():
    logits, labels = torch.randn(2, 5, 30) * 2, torch.randint(0, 30, (2, 5))
    log_probs, entropy = log_probs_and_entropy_from_logits(logits, labels, temperature=0.5, chunk_tokens=3)
    torch.testing.assert_close(log_probs, log_probs_from_logits(logits, labels, temperature=0.5), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, entropy_from_logits(logits, temperature=0.5), atol=1e-6, rtol=1e-6)
    # Sharper at 0.5 than at 1: the scale really reaches the softmax.
    assert (entropy < entropy_from_logits(logits)).all()


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="disagree"):
        log_probs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_temperature_must_be_finite_and_positive(temperature):
    logits, labels = torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)
    for call in (
        lambda: log_probs_from_logits(logits, labels, temperature=temperature),
        lambda: entropy_from_logits(logits, temperature=temperature),
        lambda: log_probs_and_entropy_from_logits(logits, labels, temperature=temperature),
    ):
        with pytest.raises(ValueError, match="temperature=.* must be a finite number > 0"):
            call()


def test_vocabulary_parallel_matches_one_rank_at_a_temperature():
    """Two ranks, each holding an unequal slice of the vocabulary, against the full-vocabulary float32 reference."""
    finished = torchrun("vocab_parallel_logprob.py", nproc=2, timeout=120, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    assert finished.stdout.count("ok rank") == 2, finished.stdout[-2000:]


_PEAK_SCRIPT = textwrap.dedent(
    """
    import torch
    from spmd_rlhf.models import entropy_from_logits, log_probs_from_logits

    def peak_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    torch.manual_seed(0)
    tokens, vocab = 1024, 131072
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,))
    for mode in ("chunked", "naive"):  # each from the same resident set: what a pass adds, freed after it
        reset_peak()
        before = peak_bytes()
        with torch.no_grad():
            if mode == "chunked":
                log_probs_from_logits(logits, labels); entropy_from_logits(logits)
            else:
                log_softmax = logits.float().log_softmax(-1)
                log_softmax.gather(-1, labels[:, None]); (log_softmax.exp() * log_softmax).sum(-1)
                del log_softmax
        print(peak_bytes() - before)
    """
)


def _forward_peaks() -> tuple[int, int]:
    """The chunked and the naive pass's peak resident-set rise, in one fresh process (the largest blocks are mapped
    on their own and returned when freed, so the second pass starts where the first did)."""
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, check=True)
    chunked, naive = map(int, result.stdout.split())
    return chunked, naive


def test_peak_memory_stays_well_below_a_float32_softmax():
    full_float32 = 1024 * 131072 * 4
    chunked, naive = _forward_peaks()
    # The naive path really does allocate the full float32 table (so this measurement can fail) ...
    assert naive >= full_float32
    # ... and the chunked path stays within a fraction of it.
    assert chunked < full_float32 // 2, (
        f"chunked peak {chunked / 2**20:.0f} MiB vs full float32 {full_float32 / 2**20:.0f} MiB"
    )
