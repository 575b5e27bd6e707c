"""The device-side sampler: supports, chi-square fits of the sampled distributions (with top-k, top-p, T != 1, per-row
parameters in one batch), batch-independence of seeded requests, log-probs (unfiltered, and under the filtered
distribution each token was drawn from), the hash against exact integer arithmetic, and the peak memory its docstring
states."""

import math

import pytest
import torch

from spmd_rlhf.engine.sampler import (
    _MASK64,
    FILTERED,
    SEARCH_CHUNK,
    argmax_in_chunks,
    derive_seed,
    draw,
    filter_logits,
    inverse_cdf,
    row_sampling,
    row_uniforms,
    sample,
    sample_on_device,
)
from spmd_rlhf.engine.sequence import SamplingParams
from spmd_rlhf.metrics.peak_memory import PeakMemory

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
LOGITS = PROBS.log()

# Goodness of fit: Pearson's chi-square at significance 0.001 against the critical value of chi2(df), i.e.
# scipy.stats.chi2.ppf(0.999, df). The noise is a hash of fixed keys, so each test's statistic is a fixed number:
# the level says how unlucky a correct sampler would have to be for these keys to fail.
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
DRAWS = 20_000


def _sample(logits, params, seeds, positions):
    return sample(logits, params, seeds=seeds, positions=positions)


def _draw(logits_row: torch.Tensor, params: SamplingParams, seed: int) -> list[int]:
    """DRAWS tokens of one request from the same logits, at positions 0..DRAWS-1, in one batch."""
    tokens, _, _ = _sample(logits_row.expand(DRAWS, -1), [params] * DRAWS, [seed] * DRAWS, list(range(DRAWS)))
    return tokens


def _assert_fits(tokens: list[int], expected: torch.Tensor) -> None:
    """Tokens outside the support never drawn; the rest pass Pearson's chi-square test against ``expected``."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    wanted = expected[support].double() / expected[support].sum() * len(tokens)
    statistic = float(((counts[support] - wanted) ** 2 / wanted).sum())
    df = int(support.sum()) - 1
    critical = CHI2_CRITICAL_999[df]
    assert statistic < critical, f"chi2={statistic:.2f} >= {critical} (df={df}): {counts.tolist()}"


def test_greedy_takes_the_argmax_with_its_plain_log_prob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    tokens, log_probs, _ = _sample(logits, [SamplingParams(temperature=0)] * 2, [0, 0], [0, 0])
    assert tokens == [1, 0]
    expected = logits.log_softmax(-1)[[0, 1], [1, 0]]
    torch.testing.assert_close(torch.tensor(log_probs), expected)


def test_top_k_and_top_p_supports():
    assert torch.isinf(filter_logits(LOGITS, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(LOGITS, top_k=0, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(LOGITS, top_k=0, top_p=0.85)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(LOGITS, top_k=0, top_p=0.01)).tolist() == [[False, True, True, True]]


def test_per_row_top_k_and_top_p_equal_each_row_filtered_alone():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 2
    top_k, top_p = [0, 5, 0, 3, 49, 50], [1.0, 1.0, 0.6, 0.9, 0.3, 1.0]
    rows = torch.cat([filter_logits(logits[r : r + 1], top_k=top_k[r], top_p=top_p[r]) for r in range(6)])
    torch.testing.assert_close(filter_logits(logits, top_k=top_k, top_p=top_p), rows)
    kept = (~torch.isinf(rows)).sum(-1).tolist()
    assert kept[0] == kept[5] == 50 and kept[1] == 5 and kept[3] <= 3 and 1 <= kept[2] < 50
    # Top-k alone takes topk rather than a sort: the same supports.
    torch.testing.assert_close(
        filter_logits(logits, top_k=top_k, top_p=1.0),
        torch.cat([filter_logits(logits[r : r + 1], top_k=top_k[r], top_p=1.0) for r in range(6)]),
    )


def test_ties_with_the_last_kept_token_stay_in():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [[False, False, False, True]]


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), PROBS[0]),
        (SamplingParams(top_k=3), torch.tensor([0.5, 0.3, 0.15, 0.0])),
        (SamplingParams(top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0.0])),
        (SamplingParams(temperature=0.5), PROBS[0] ** 2),
        (SamplingParams(temperature=2.0, top_p=0.6), torch.tensor([0.5**0.5, 0.3**0.5, 0.0, 0.0])),
        (SamplingParams(temperature=1.5, top_k=3, top_p=0.9), (PROBS[0] ** (1 / 1.5)) * torch.tensor([1, 1, 1, 0])),
    ],
    ids=["t1", "topk3", "topp0.85", "t0.5", "t2-topp0.6", "t1.5-topk3-topp0.9"],
)
def test_sampled_frequencies_pass_a_chi_square_test(params, expected):
    _assert_fits(_draw(LOGITS[0], params, seed=11), expected)


def test_t1_5_top_k_3_top_p_0_9_keeps_three_tokens():
    """The support the last chi-square case assumes: top-p on the top-k distribution at T = 1.5 keeps all three."""
    scaled = LOGITS / 1.5
    assert torch.isinf(filter_logits(scaled, top_k=3, top_p=0.9)).tolist() == [[False, False, False, True]]


def test_a_wider_vocabulary_fits_too():
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(3))
    _assert_fits(_draw(logits[0], SamplingParams(temperature=0.8), seed=5), (logits[0] / 0.8).softmax(-1))


def test_per_row_params_in_one_batch():
    """Greedy rows, rows at different temperatures, top-k and top-p, interleaved in one batch: each row draws what it
    draws alone, and each kind of row follows its own distribution."""
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5),
        SamplingParams(top_k=2),
        SamplingParams(temperature=2.0, top_p=0.6),
    ]
    expected = [None, PROBS[0] ** 2, torch.tensor([0.5, 0.3, 0, 0]), torch.tensor([0.5**0.5, 0.3**0.5, 0, 0])]
    rows = DRAWS * len(kinds)
    params = [kinds[row % len(kinds)] for row in range(rows)]
    seeds, positions = [row % 97 for row in range(rows)], [row // 4 for row in range(rows)]
    tokens, log_probs, _ = _sample(LOGITS.expand(rows, -1), params, seeds, positions)
    assert set(tokens[0::4]) == {0} and all(lp == pytest.approx(math.log(0.5), abs=1e-6) for lp in log_probs[0::4])
    for kind in range(1, len(kinds)):
        _assert_fits(tokens[kind::4], expected[kind])
    for row in (1, 2, 3, 6, 7, 4005, 4006, 4007):
        alone, _, _ = _sample(LOGITS, [params[row]], [seeds[row]], [positions[row]])
        assert alone == [tokens[row]]


def test_log_prob_is_at_temperature_and_before_filtering():
    params = SamplingParams(temperature=0.5, top_k=2)
    tokens, log_probs, _ = _sample(LOGITS.expand(64, -1), [params] * 64, [1] * 64, list(range(64)))
    assert set(tokens) == {0, 1}
    expected = (LOGITS / 0.5).log_softmax(-1)[0, tokens]
    torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.7, top_k=8, top_p=0.8),
    ],
    ids=["t0.8-topp0.9", "t1.3-topk5", "t0.7-topk8-topp0.8"],
)
def test_sampling_log_prob_is_under_the_filtered_renormalised_distribution(params):
    """The sampled log-prob is the chosen token's under log_softmax of the explicitly filtered logits; the unfiltered
    one stays log_softmax(logits / T)."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(6)) * 2
    rows = 64
    tokens, log_probs, sampling_log_probs = _sample(
        logits.expand(rows, -1), [params] * rows, [5] * rows, list(range(rows))
    )
    scaled = logits / params.temperature
    filtered = filter_logits(scaled, top_k=params.top_k, top_p=params.top_p)
    assert (~torch.isinf(filtered[0]))[tokens].all()  # every drawn token is inside the top-k / top-p support
    # The two log-probs differ by the support's log-mass log Z (< 0 here: the case filters), the same on every row.
    log_mass = float(filtered.logsumexp(-1) - scaled.logsumexp(-1))
    assert log_mass < -1e-3
    gap = torch.tensor(sampling_log_probs) - torch.tensor(log_probs)
    torch.testing.assert_close(gap, torch.full((rows,), -log_mass), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(log_probs), scaled.log_softmax(-1)[0, tokens], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(sampling_log_probs), filtered.log_softmax(-1)[0, tokens], atol=1e-6, rtol=0)


def test_rows_that_keep_every_token_record_the_unfiltered_log_prob_exactly():
    """Greedy rows and rows without top-k / top-p (top_k at least the vocabulary keeps all) record the unfiltered
    log-prob bit for bit, beside filtering rows in one batch and in batches where no row filters."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(7)) * 2
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.9, top_p=0.5),
        SamplingParams(temperature=1.1, top_k=50),
        SamplingParams(temperature=1.1, top_k=3),
    ]
    rows = len(params)
    _, log_probs, sampling_log_probs = _sample(logits.expand(rows, -1), params, [1] * rows, [0] * rows)
    assert [sampling_log_probs[row] == log_probs[row] for row in range(rows)] == [True, True, False, True, False]
    assert sampling_log_probs[2] > log_probs[2] and sampling_log_probs[4] > log_probs[4]
    for unfiltered in ([params[0]] * 2, [params[1], params[3]], [params[0], params[1]]):
        _, log_probs, sampling_log_probs = _sample(logits.expand(2, -1), unfiltered, [1, 2], [0, 0])
        assert sampling_log_probs == log_probs


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch_and_row():
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    alone = [_sample(logits, [params], [7], [position])[0][0] for position in range(20)]
    assert len(set(alone)) > 5
    generator = torch.Generator().manual_seed(2)
    for position in range(20):
        others = torch.randn(5, 1000, generator=generator)
        row = position % 6
        batch = torch.cat([others[:row], logits, others[row:]])
        other_params = [SamplingParams(temperature=0.7, top_k=10), SamplingParams(temperature=0)] + [params] * 3
        batch_params = other_params[:row] + [params] + other_params[row:]
        seeds = [100, 101, 7, 102, 103][:row] + [7] + [100, 101, 7, 102, 103][row:]
        positions = [3, 4, 5, 6, 7][:row] + [position] + [3, 4, 5, 6, 7][row:]
        tokens, _, _ = _sample(batch, batch_params, seeds, positions)
        assert tokens[row] == alone[position]
    other_seed = [_sample(logits, [params], [8], [position])[0][0] for position in range(20)]
    assert other_seed != alone


@pytest.mark.parametrize("top_p", [1.0, 0.8], ids=["top-k alone", "top-k and top-p"])
def test_the_draw_a_graph_holds_equals_the_host_built_draw(top_p):
    """The captured decode step's draw (``decode_graphs``: every row's values as device tensors, a filtered batch
    always sorted) gives exactly the tokens and log-probs of ``sample_on_device``, which takes ``topk`` when no row
    has top-p: the same support floors."""
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=5, seed=1),
        SamplingParams(temperature=0.7, seed=2),
        SamplingParams(temperature=0.5, top_k=64, seed=3),  # the whole vocabulary: no filter
        SamplingParams(temperature=1.0, top_k=3, top_p=top_p, seed=4),
        SamplingParams(temperature=0),
    ]
    seeds, positions = [11, 1, 2, 3, 4, 12], [0, 5, 9, 2, 7, 3]
    _, expected = sample_on_device(logits, params, seeds=seeds, positions=positions)
    kinds, temperature, top_k, top_ps, greedy = zip(*(row_sampling(row, 64) for row in params))
    assert max(kinds) == FILTERED
    _, got = draw(
        logits,
        kind=FILTERED,
        temperature=torch.tensor(temperature, dtype=torch.float32),
        uniforms=torch.tensor(row_uniforms(seeds, positions), dtype=torch.float64),
        greedy=torch.tensor(greedy),
        top_k=torch.tensor(top_k),
        top_p=torch.tensor(top_ps, dtype=torch.float32),
    )
    assert torch.equal(got, expected)


def test_temperature_sharpens():
    (token,), (log_prob,), _ = _sample(LOGITS, [SamplingParams(temperature=1e-3)], [0], [0])
    assert token == 0 and log_prob == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(log_prob)


def test_low_precision_logits_are_scaled_in_float32():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.7, seed=0)] * 3
    tokens, log_probs, _ = _sample(logits, params, [1, 2, 3], [0, 0, 0])
    expected = (logits.float() / 0.7).log_softmax(-1)[[0, 1, 2], tokens]
    torch.testing.assert_close(torch.tensor(log_probs), expected, atol=1e-6, rtol=0)


def test_row_uniforms_are_the_exact_integer_hash():
    generator = torch.Generator().manual_seed(3)
    drawn = torch.randint(0, 2**62, (64,), generator=generator).tolist()
    # Every row at once in numpy's uint64 arithmetic, bit for bit the Python integers' hash: seeds at both ends of
    # 64 bits, negative and past 2^64 (taken modulo 2^64), and many rows of full-width seeds.
    seeds = [0, -1, 2**63 - 1, 2**64 - 1, 12345, 2**64 + 5, *(seed * 4 + 3 for seed in drawn)]
    positions = [0, 7, 2**40, 9, 1, 3, *range(64)]
    for rows in (seeds, seeds[:6]):  # numpy's path, and the Python integers' for a few rows
        for uniform, seed, position in zip(row_uniforms(rows, positions[: len(rows)]), rows, positions, strict=False):
            assert uniform == min(((derive_seed(seed, position) >> 11) + 0.5) * 2.0**-53, 1 - 2**-30)
    assert derive_seed(-1, 7) == derive_seed(_MASK64, 7) and derive_seed(2**64 + 5, 3) == derive_seed(5, 3)


def test_row_uniforms_repeat_for_a_key_and_are_uniform_across_keys():
    assert row_uniforms([5], [10]) == row_uniforms([5], [10])
    count = 40_000
    uniforms = torch.tensor(row_uniforms([7] * count, list(range(count))), dtype=torch.float64)
    assert 0 < uniforms.min() and uniforms.max() < 1
    counts = torch.bincount((uniforms * 8).long(), minlength=8).double()
    assert float(((counts - count / 8) ** 2 / (count / 8)).sum()) < CHI2_CRITICAL_999[7]
    # Neighbouring positions are uncorrelated: a lag-1 correlation of 5 standard deviations is a 1e-6 event.
    assert torch.corrcoef(torch.stack([uniforms[:-1], uniforms[1:]]))[0, 1].abs() < 5 / math.sqrt(count)


def test_a_token_outside_the_support_is_never_drawn():
    # Row 0: one token holds almost all the mass and the rest is cut by top-k 1; row 1: zero-probability tokens on
    # both sides of the support; every draw lands inside, whatever the uniform.
    logits = torch.tensor([[0.0, 50.0, 0.0, 0.0], [-1e30, 0.0, 0.0, -1e30]])
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)]
    for seed in range(200):
        tokens, _, _ = _sample(logits, params, [seed, seed], [0, 0])
        assert tokens[0] == 1 and tokens[1] in (1, 2)


@pytest.mark.parametrize("vocab", [7, SEARCH_CHUNK, SEARCH_CHUNK + 1, 3 * SEARCH_CHUNK + 100])
def test_the_two_level_search_finds_what_one_float64_cumulative_sum_finds(vocab):
    generator = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(300, vocab, generator=generator) * 4, dim=-1)
    probs[:, 1::3] = 0  # tokens without mass between those with it
    uniforms = torch.rand(300, generator=generator, dtype=torch.float64)
    uniforms[:2] = torch.tensor([2.0**-53, 1 - 2.0**-30], dtype=torch.float64)  # the extremes row_uniforms makes
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
    expected = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True).squeeze(1)
    tokens, mass = inverse_cdf(probs, uniforms)
    assert torch.equal(tokens, expected)
    torch.testing.assert_close(mass, cumulative[:, -1], rtol=1e-12, atol=0)


def test_rounding_between_the_two_levels_never_draws_outside_the_support():
    # The first chunk: one token of mass 1 and 1,023 of 0.75 * 2^-53, each too small to move a float64 running sum
    # past 1, while the chunk's sum (summed in a tree) is 1 + 378 * 2^-52; the second chunk's first token has no
    # mass. A target between the two sums passes the chunk's own cumulative total: the chunk's last token with mass
    # is drawn, not the next chunk's first.
    probs = torch.zeros(1, 2 * SEARCH_CHUNK)
    probs[0, 0], probs[0, 1:SEARCH_CHUNK], probs[0, SEARCH_CHUNK + 1] = 1.0, 0.75 * 2.0**-53, 1.0
    chunk_mass = probs[:, :SEARCH_CHUNK].sum(dim=-1, dtype=torch.float64).item()
    assert chunk_mass > probs[0, :SEARCH_CHUNK].double().cumsum(0)[-1].item() == 1.0
    uniforms = torch.tensor([(1 + (chunk_mass - 1) / 2) / (chunk_mass + 1)], dtype=torch.float64)
    tokens, _ = inverse_cdf(probs, uniforms)
    assert tokens.tolist() == [SEARCH_CHUNK - 1]


@pytest.mark.parametrize("vocab", [7, SEARCH_CHUNK, 3 * SEARCH_CHUNK + 100])
def test_the_chunked_argmax_and_logsumexp_equal_one_pass_over_the_row(vocab):
    generator = torch.Generator().manual_seed(vocab)
    values = torch.randn(6, vocab, generator=generator).round(decimals=1)  # ties within and across chunks
    last = vocab - 1
    values[1, [0, last]] = 9.0  # a tie between the first and the last chunk: the first index wins
    values[2, :] = float("-inf")  # chunks whose every value is -inf, and one token left
    values[2, last] = 0.5
    values[3, last // 2] = float("inf")
    values[4, :] = 1.0  # one value everywhere: index 0
    tokens, log_normaliser = argmax_in_chunks(values, normaliser=True)
    assert torch.equal(tokens, values.argmax(dim=-1))
    assert tokens[1] == 0 and tokens[2] == last and tokens[4] == 0
    torch.testing.assert_close(log_normaliser, values.logsumexp(dim=-1))
    assert argmax_in_chunks(values)[1] is None


def test_any_uniform_gives_a_token_index_in_range():
    # A padding row of a graphed step may hold a stale uniform; whatever it is (negative, past 1, NaN), the draw's
    # index stays inside the vocabulary where the chunk it lands in has no mass, so no gather reads out of range.
    probs = torch.zeros(4, 2 * SEARCH_CHUNK + 5)
    probs[:, SEARCH_CHUNK + 3] = 1.0
    uniforms = torch.tensor([-0.5, 1.5, float("nan"), 0.0], dtype=torch.float64)
    tokens, _ = inverse_cdf(probs, uniforms)
    assert ((tokens >= 0) & (tokens < probs.shape[1])).all() and tokens[3] == SEARCH_CHUNK + 3


def test_peak_memory_is_as_documented():
    rows, vocab = 8, 20_000
    logits = torch.randn(rows, vocab)
    elements = rows * vocab
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=100 * (row % 2)) for row in range(rows)]
    with PeakMemory("cpu") as memory:
        _sample(logits, params, list(range(rows)), [0] * rows)
    # 16 bytes per element documented while the support floor sorts; a little room for per-row vectors.
    assert 12 * elements <= memory.peak_increase <= 17 * elements, memory.peak_increase / elements
    sampled = [SamplingParams(temperature=0.9)] * rows
    with PeakMemory("cpu") as memory:
        _sample(logits, sampled, list(range(rows)), [0] * rows)
    # 8 bytes per element at most (the float32 copy, and the exponentials of the whole chunks, the largest of the
    # pieces the search's first level sums) and 32 per row and search-chunk token documented (no float64 cumulative
    # sum over the vocabulary, which alone was 8 bytes per element).
    search = 32 * rows * SEARCH_CHUNK
    assert 7 * elements <= memory.peak_increase <= 8 * elements + search, (memory.peak_increase - 8 * elements) / search
    greedy = [SamplingParams(temperature=0)] * rows
    with PeakMemory("cpu") as memory:
        _sample(logits, greedy, [0] * rows, [0] * rows)
    assert memory.peak_increase <= 4.1 * elements, memory.peak_increase / elements
