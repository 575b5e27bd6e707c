import math

import pytest
import torch

from spmd_rlhf.engine.sampler import Sampler, filter_logits
from spmd_rlhf.engine.sequence import SamplingParams

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_with_its_plain_log_prob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    tokens, log_probs = Sampler()(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert tokens == [1, 0]
    expected = logits.log_softmax(-1)[[0, 1], [1, 0]]
    torch.testing.assert_close(torch.tensor(log_probs), expected)


def test_top_k_and_top_p_supports():
    assert torch.isinf(filter_logits(LOGITS, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(LOGITS, top_k=0, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(LOGITS, top_k=0, top_p=0.85)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(LOGITS, top_k=0, top_p=0.01)).tolist() == [[False, True, True, True]]


def test_sampled_frequencies_follow_the_filtered_distribution():
    sampler = Sampler()
    generator = _generator(0)
    counts = torch.zeros(4)
    for _ in range(3000):
        (token,), _ = sampler(LOGITS, [SamplingParams(top_k=3)], [generator])
        counts[token] += 1
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    torch.testing.assert_close(counts / counts.sum(), expected, atol=0.03, rtol=0)


def test_log_prob_is_at_temperature_and_before_filtering():
    params = SamplingParams(temperature=0.5, top_k=2)
    (token,), (log_prob,) = Sampler()(LOGITS, [params], [_generator(1)])
    assert log_prob == pytest.approx(float((LOGITS / 0.5).log_softmax(-1)[0, token]), abs=1e-6)
    assert token in (0, 1)


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch():
    sampler = Sampler()
    params = SamplingParams(temperature=1.0)
    alone, in_batch = _generator(7), _generator(7)
    other = torch.randn(1, 4)
    for _ in range(20):
        (token_alone,), _ = sampler(LOGITS, [params], [alone])
        tokens, _ = sampler(torch.cat([other, LOGITS]), [params, params], [None, in_batch])
        assert tokens[1] == token_alone


def test_temperature_sharpens():
    (token,), (log_prob,) = Sampler()(LOGITS, [SamplingParams(temperature=1e-3)], [_generator(0)])
    assert token == 0 and log_prob == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(log_prob)
