"""Next-token choice from last-position logits, for every row at once on the logits' device: greedy, temperature,
top-k, top-p, per-request seeds.

Sampling is by inverse CDF: the token is the first whose cumulative probability (softmax(logits / T) over the top-k /
top-p support, summed in float64, in two levels: ``inverse_cdf``) exceeds u times the support's mass, with u a
counter-based uniform: a hash of
(request seed, response position), one per row. The draw is a function of its key, not a generator's stream, so a
request's tokens depend only on its seed, its positions and its own logits: never on the other rows of the batch,
their order, preemption, or how many steps ran before. One uniform per row (where Gumbel-max needs one per
vocabulary entry) keeps the step to a softmax, a cumulative sum and a search, which at a 151,936-token vocabulary
is what decides the sampler's time. Only the chosen ids and their two log-probs (three [rows] vectors) reach the
host, in one copy per step: at once (``sample``), or one step late (``llm_engine``'s overlapped loop). The draw
itself (``draw``) takes every per-row value as a device tensor, so a CUDA graph holds it (``decode_graphs``: the
captured decode step samples inside the graph); ``sample_on_device`` builds those tensors from ``SamplingParams``.

Each chosen token comes with two log-probs:

- log softmax(logits / T) at the token (T = 1 for greedy), before top-k / top-p filtering: the same quantity the
  trainer's ``compute_log_probs`` computes at that temperature, so rollout and training log-probs agree to rounding
  (``rollout_log_probs``);
- its log-prob under the distribution it was drawn from, that softmax restricted to the top-k / top-p support and
  renormalised: the unfiltered log-prob minus log Z, Z the support's mass (the last entry of the cumulative sum the
  draw already needs, so it costs no extra pass over the vocabulary). This is the behaviour policy of an importance
  correction (``sampling_log_probs``). A row that keeps every token (top_k 0 or at least the vocabulary, and top_p
  1) records the unfiltered value exactly, not less the log of a float sum near 1. So does a greedy row: its draw
  is a point mass (log-prob 0), but greedy responses (validation, ReMax's baseline) are never trained on, and the
  unfiltered value keeps the two fields equal wherever nothing was filtered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from spmd_rlhf.engine.sequence import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_LARGEST_UNIFORM = 1.0 - 2.0**-30


def _to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A per-row vector built on the host, sent without waiting: a non-blocking copy from pageable memory is staged at
    once, so the host never stalls here for the model's queued work; the step's one sync is the final ``tolist``."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int in [0, 2^64): a bijection in which every output bit depends on every
    input bit. Python ints are exact, so this runs on the host, once per row."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(seed: int, counter: int) -> int:
    """A 64-bit seed for draw number ``counter`` under ``seed`` (both taken modulo 2^64); distinct counters give
    distinct seeds. Keys a row's noise by (request seed, position), and an unseeded request's seed by (engine seed,
    request number)."""
    return _mix64((_mix64(seed & _MASK64) + counter * _GOLDEN_GAMMA) & _MASK64)


def row_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """One float64 uniform per row in (0, 1 - 2^-30]: the top 53 bits v of ``derive_seed(seeds[r], positions[r])`` as
    (v + 1/2) / 2^53, computed on the host (the same on every device), for every row at once in numpy's wrapping
    uint64 arithmetic: bit for bit ``derive_seed``'s Python integers, in a few microseconds for 256 rows where a loop
    over them took hundreds (``benchmarks/host_overhead.py --decode``). The cap keeps u times a row's mass below that
    mass after rounding, so the search in ``sample`` always lands inside the support."""
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds for {len(positions)} positions")
    if len(seeds) < _NUMPY_ROWS:  # numpy's fixed cost (about 10 us) is more than a few rows of Python integers
        return np.array(
            [
                min(((derive_seed(seed, position) >> 11) + 0.5) * 2.0**-53, _LARGEST_UNIFORM)
                for seed, position in zip(seeds, positions)
            ]
        )
    try:
        keys = np.array(seeds, dtype=np.uint64)
    except OverflowError:  # a negative or oversized seed, taken modulo 2^64 as derive_seed takes it
        keys = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)
    counters = np.array(positions, dtype=np.uint64)  # positions in a sequence: small and non-negative
    bits = _mix64_array(_mix64_array(keys) + counters * np.uint64(_GOLDEN_GAMMA))
    return np.minimum(((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53, _LARGEST_UNIFORM)


_NUMPY_ROWS = 16
"""From this many rows on, ``row_uniforms`` hashes in numpy (1 row: 1 us in Python, 12 in numpy; 256 rows: 455 us in
Python, 28 in numpy)."""


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """``_mix64`` of every element of a uint64 array (products wrap modulo 2^64, as ``& _MASK64`` makes them)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _support_floor(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, largest_k: int | None
) -> torch.Tensor:
    """Per row, the smallest logit of its top-k / top-p support (tokens tied with it stay in; the best token always
    does). ``top_k`` ``[rows]`` int64, 0 for no top-k; ``top_p`` ``[rows]`` in the logits' dtype, inf for no top-p.
    Top-p applies to the distribution left after top-k. ``largest_k``: when no row has top-p, the largest k, and the
    rows are not sorted (``torch.topk`` of that many); None sorts them, which any top-k / top-p takes.

    Holds at peak, when sorting: the sorted values and their int64 indices, then the sorted values, their softmax and
    its cumulative sum (16 bytes per [rows, vocab] element)."""
    sorts = largest_k is None
    ranked = logits.sort(dim=-1, descending=True).values if sorts else logits.topk(largest_k, dim=-1).values
    kth = ranked.gather(1, (top_k - 1).clamp(min=0)[:, None]).squeeze(1)
    floor = torch.where(top_k > 0, kth, float("-inf"))
    if sorts:
        probs = ranked.masked_fill(ranked < floor[:, None], float("-inf")).softmax(dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p, so the best one never is.
        mass_above = probs.cumsum(dim=-1).sub_(probs)
        del probs
        kept = (mass_above < top_p[:, None]).sum(dim=-1)
        floor = torch.maximum(floor, ranked.gather(1, (kept - 1)[:, None]).squeeze(1))
    return floor


def _host_floor(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor | None:
    """``_support_floor`` of per-row lists (``SamplingParams`` values), or None when no row filters; sorts only when
    some row has top_p < 1."""
    vocab_size = logits.shape[-1]
    ks = [k if 0 < k < vocab_size else 0 for k in top_k]
    sorts = any(p < 1 for p in top_p)
    if not sorts and not any(ks):
        return None
    return _support_floor(
        logits,
        _to_device(ks, torch.int64, logits.device),
        _to_device([p if p < 1 else float("inf") for p in top_p], logits.dtype, logits.device),
        largest_k=None if sorts else max(ks),
    )


def filter_logits(logits: torch.Tensor, *, top_k: int | Sequence[int], top_p: float | Sequence[float]) -> torch.Tensor:
    """``logits`` [rows, vocab] with tokens outside the top-k / top-p sets set to -inf; ``top_k`` and ``top_p`` are one
    value for every row or one per row (0 and 1 keep every token)."""
    rows = logits.shape[0]
    floor = _host_floor(
        logits,
        [top_k] * rows if isinstance(top_k, int) else top_k,
        [top_p] * rows if isinstance(top_p, float | int) else top_p,
    )
    return logits if floor is None else logits.masked_fill(logits < floor[:, None], float("-inf"))


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], *, seeds: Sequence[int], positions: Sequence[int]
) -> tuple[list[int], list[float], list[float]]:
    """One token per row of ``logits`` [rows, vocab] (any float dtype, any device) with its unfiltered and its sampled
    log-prob (module docstring), row r under ``params[r]``, its draw keyed by ``seeds[r]`` and ``positions[r]`` (the
    index of the token in its response). Greedy and sampled rows, and rows with different temperatures, top-k and
    top-p, mix freely in one batch. ``sample_on_device`` then ``read_samples``: this step's one sync."""
    _, samples = sample_on_device(logits, params, seeds=seeds, positions=positions)
    return read_samples(samples.tolist())


def read_samples(rows: list[list[float]]) -> tuple[list[int], list[float], list[float]]:
    """``sample``'s three lists from the three rows of ``sample_on_device``'s samples, read on the host."""
    token_row, log_prob_row, sampling_log_prob_row = rows
    return [int(token) for token in token_row], log_prob_row, sampling_log_prob_row


SEARCH_CHUNK = 1024
"""Tokens per chunk of the draw's two-level reductions (``argmax_in_chunks``) and search (``inverse_cdf``'s first
level): at a 151,936-token vocabulary 149 chunks per row, and the second level's cumulative sum over 1,024 tokens."""


def _chunked(values: torch.Tensor) -> list[torch.Tensor]:
    """``values`` ``[rows, vocab]`` as ``[rows, chunks, size]`` views: whole chunks of ``SEARCH_CHUNK`` tokens, then
    the rest as one more (the vocabulary stays static to TorchDynamo, so which there are is fixed per graph)."""
    rows, vocab = values.shape
    whole = vocab // SEARCH_CHUNK * SEARCH_CHUNK
    pieces = [values[:, :whole].reshape(rows, -1, SEARCH_CHUNK)] if whole else []
    return pieces + ([values[:, whole:].unsqueeze(1)] if whole < vocab else [])


def argmax_in_chunks(values: torch.Tensor, *, normaliser: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of ``values`` ``[rows, vocab]``: the index of its first largest value (``values.argmax(-1)``'s) and,
    with ``normaliser``, its logsumexp, both in two levels over chunks of ``SEARCH_CHUNK`` tokens.

    Inductor never splits an argmax, so a compiled ``argmax(-1)`` of one row of a 151,936-token vocabulary ran as one
    program, 35 µs of the 1.56 ms batch-1 decode step on an H200 (session 47). Here each chunk's maximum, first index
    and (``normaliser``) sum of exponentials are a reduction per chunk, rows × chunks programs; the first largest
    chunk maximum's chunk holds the first largest value, so the index is ``argmax``'s, ties included. The logsumexp
    is ``torch.logsumexp``'s up to summation order (chunks shifted by their maxima, infinite ones by zero)."""
    maxima, indices, sums = [], [], []
    start = 0
    for piece in _chunked(values):
        chunk_max, chunk_index = piece.max(dim=-1)
        maxima.append(chunk_max)
        indices.append(chunk_index + start + torch.arange(piece.shape[1], device=values.device) * piece.shape[2])
        if normaliser:
            shift = torch.where(chunk_max.abs() == float("inf"), 0.0, chunk_max)
            sums.append((piece - shift[..., None]).exp_().sum(dim=-1).log() + shift)
        start += piece.shape[1] * piece.shape[2]
    maxima, indices = torch.cat(maxima, dim=1), torch.cat(indices, dim=1)
    tokens = indices.gather(1, maxima.argmax(dim=-1, keepdim=True)).squeeze(1)
    return tokens, torch.logsumexp(torch.cat(sums, dim=1), dim=-1) if normaliser else None


def _argmax(values: torch.Tensor, *, normaliser: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``argmax_in_chunks`` where TorchDynamo traces the draw (``decode_compile.compile_draw``); run eagerly, torch's
    own argmax and logsumexp, which spread each row over the GPU already and launch fewer kernels."""
    if torch.compiler.is_compiling():
        return argmax_in_chunks(values, normaliser=normaliser)
    return values.argmax(dim=-1), torch.logsumexp(values, dim=-1) if normaliser else None


def _chunk_masses(probs: torch.Tensor) -> torch.Tensor:
    """The masses of ``probs``' ``SEARCH_CHUNK``-token chunks, ``[rows, chunks]``, summed in float64."""
    return torch.cat([piece.sum(dim=-1, dtype=torch.float64) for piece in _chunked(probs)], dim=1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``probs`` ``[rows, vocab]`` (non-negative, some mass in every row), the first token whose cumulative
    mass, summed in float64, exceeds ``uniforms`` (``[rows]`` float64 in (0, 1 - 2^-30]) times the row's mass; returns
    the tokens ``[rows]`` (int64) and the masses ``[rows]`` (float64).

    In two levels, so that no float64 ``[rows, vocab]`` cumulative sum is written (at 256 rows and a 151,936-token
    vocabulary it was 311 MB per decode step, besides reading the probabilities for it): the masses of chunks of
    ``SEARCH_CHUNK`` tokens and their cumulative sum find the chunk the target falls in, then a cumulative sum over
    that chunk alone finds the token. The chunk the target falls in has mass, and the token found has mass of its own
    (the cumulative sum steps past the target at it). Where the two sums' rounding leaves the target past the chunk's
    own cumulative total, the chunk's last token with mass is taken: no token outside the support is ever drawn."""
    return search(_chunk_masses(probs), uniforms, lambda indices: probs.gather(1, indices), probs.shape[1])


def search(
    chunk_masses: torch.Tensor, uniforms: torch.Tensor, at: Callable[[torch.Tensor], torch.Tensor], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``inverse_cdf`` from its first level's chunk masses ``[rows, chunks]`` (float64) and ``at``, the probabilities
    at given token indices ``[rows, SEARCH_CHUNK]``: a draw computes both from the logits, so that compiled, no
    ``[rows, vocab]`` tensor of probabilities need be stored (Inductor computes them where they are summed)."""
    cumulative = chunk_masses.cumsum(dim=-1)
    mass = cumulative[:, -1]
    targets = (uniforms * mass)[:, None]
    chunks = torch.searchsorted(cumulative, targets, right=True).clamp_(max=cumulative.shape[1] - 1)
    before = torch.where(chunks > 0, cumulative.gather(1, (chunks - 1).clamp(min=0)), 0.0)
    offsets = torch.arange(SEARCH_CHUNK, device=chunk_masses.device)
    indices = chunks * SEARCH_CHUNK + offsets
    outside = indices >= vocab
    chunk_probs = at(indices.clamp_(max=vocab - 1)).masked_fill_(outside, 0.0)
    within = chunk_probs.cumsum(dim=-1, dtype=torch.float64).add_(before)
    found = torch.searchsorted(within, targets, right=True)
    last_with_mass = torch.where(chunk_probs > 0, offsets, -1).amax(dim=-1, keepdim=True)
    tokens = (chunks * SEARCH_CHUNK + torch.minimum(found, last_with_mass)).squeeze(1)
    # An index whatever the uniforms hold (a padding row's are stale values): a gather never reads out of bounds.
    return tokens.clamp_(0, vocab - 1), mass


def _search_scaled(
    scaled: torch.Tensor,
    scaled_at: Callable[[torch.Tensor], torch.Tensor],
    floor: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled draw's search over ``scaled`` (the logits divided by T; ``scaled_at``: its values at given indices),
    its support the tokens at or above ``floor`` (None: every token): ``(tokens, log normaliser, the support's
    weight, the row's total weight)``, the weights ``exp(scaled - the row's max)``, unnormalised (the search draws u
    times the row's own mass), summed in float64 by chunks (the search's first level; without filters, the total
    too). Each use of them is a reduction or a gather from the logits, so compiled, no ``[rows, vocab]`` tensor of
    them is written: Inductor computes them where they are read."""
    maxes = scaled.amax(dim=-1, keepdim=True)

    def weights(values: torch.Tensor, *, support: bool = True) -> torch.Tensor:
        shape = (-1,) + (1,) * (values.dim() - 1)  # values [rows, ...]
        chosen = (values - maxes.view(shape)).exp_()
        if floor is None or not support:
            return chosen
        return chosen.masked_fill_(values < floor.view(shape), 0.0)

    def masses(*, support: bool = True) -> torch.Tensor:
        pieces = _chunked(scaled)
        return torch.cat([weights(p, support=support).sum(dim=-1, dtype=torch.float64) for p in pieces], dim=1)

    total = None if floor is None else masses(support=False).sum(dim=-1)
    tokens, support_weight = search(masses(), uniforms, lambda indices: weights(scaled_at(indices)), scaled.shape[1])
    total = support_weight if total is None else total
    return tokens, (total.log() + maxes.squeeze(1)).to(scaled.dtype), support_weight, total


GREEDY, SAMPLED, FILTERED = 0, 1, 2
"""Sampling kinds, each a fixed sequence of device work: every row greedy (an argmax); some row sampled, none
filtered (softmax, cumulative sum, search); some row with top-k / top-p (its support's floor first). A batch's kind is
the largest of its rows'."""


def row_sampling(params: SamplingParams, vocab_size: int) -> tuple[int, float, int, float, bool]:
    """One row's sampling as ``draw`` takes it: (kind, temperature, top_k, top_p, greedy), with top_k 0 when it keeps
    every token and top_p inf when it keeps every token (greedy rows: temperature 1, nothing filtered)."""
    if params.greedy:
        return GREEDY, 1.0, 0, float("inf"), True
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    top_p = params.top_p if params.top_p < 1 else float("inf")
    return FILTERED if top_k or top_p < 1 else SAMPLED, params.temperature, top_k, top_p, False


def sample_on_device(
    logits: torch.Tensor, params: Sequence[SamplingParams], *, seeds: Sequence[int], positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample``'s draw left on the logits' device, with nothing read back: the chosen ids ``[rows]`` (int64, what a
    next decode step can take as its input) and ``samples`` ``[3, rows]`` float32 (``draw``): the per-row parameters
    built on the host and sent, then ``draw``."""
    device, vocab_size = logits.device, logits.shape[-1]
    kinds, temperature, top_k, top_p, greedy = zip(*(row_sampling(row_params, vocab_size) for row_params in params))
    kind = max(kinds)
    sampling = {"temperature": _to_device(list(temperature), torch.float32, device)}
    if kind != GREEDY:
        sampling["uniforms"] = _to_device(row_uniforms(seeds, positions), torch.float64, device)
        if any(greedy):
            sampling["greedy"] = _to_device(list(greedy), torch.bool, device)
    if kind == FILTERED:
        sampling["top_k"] = _to_device(list(top_k), torch.int64, device)
        sampling["top_p"] = _to_device(list(top_p), torch.promote_types(logits.dtype, torch.float32), device)
        if all(p == float("inf") for p in top_p):
            sampling["largest_k"] = max(top_k)
    return draw(logits, kind=kind, **sampling)


def draw_rows(
    logits: torch.Tensor, sampling: torch.Tensor, uniforms: torch.Tensor, *, kind: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw`` with the per-row parameters as ``decode_graphs``' buffers hold them, for their first ``rows`` (the
    logits' rows) entries: ``sampling`` ``[4, max_rows]`` float64, the last four of ``row_sampling``'s values
    (temperature, top_k, top_p, greedy) one row each, and ``uniforms`` ``[max_rows]`` float64 (``row_uniforms``); the
    conversions ``draw`` needs made here, on the device."""
    rows = logits.shape[0]
    temperature, top_k, top_p, greedy = sampling[:, :rows]
    uniforms = uniforms[:rows]
    values = {"temperature": temperature.to(torch.float32)}
    if kind != GREEDY:
        values |= {"uniforms": uniforms, "greedy": greedy != 0}
    if kind == FILTERED:
        values |= {
            "top_k": top_k.to(torch.int64),
            "top_p": top_p.to(torch.promote_types(logits.dtype, torch.float32)),
        }
    return draw(logits, kind=kind, **values)


def draw(
    logits: torch.Tensor,
    *,
    kind: int,
    temperature: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    largest_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [rows, vocab] by the module docstring's draw, with nothing on the host: every
    per-row value is a device tensor, so a CUDA graph can hold it (``decode_graphs``). ``kind``: the batch's
    sampling kind; ``temperature`` ``[rows]`` float32 (1 for greedy rows); ``uniforms`` ``[rows]`` float64
    (``row_uniforms``; any value for greedy rows); ``greedy`` ``[rows]`` bool (None: no greedy row); ``top_k``
    int64 and ``top_p`` (the dtype of the logits divided by T) ``[rows]`` as ``row_sampling`` gives them;
    ``largest_k`` as ``_support_floor`` takes it. Returns the chosen ids ``[rows]`` (int64) and ``samples``
    ``[3, rows]`` float32 (the ids, exact up to 2^24, and their two log-probs: one copy brings all three to the host).

    Holds at peak, on the logits' device and besides them: a float32 copy of the logits divided by T and, run
    eagerly, the float32 unnormalised probabilities of the whole chunks (at most 8 bytes per [rows, vocab] element;
    the search adds about 32 bytes per row and token of ``SEARCH_CHUNK``); a filtered batch's support floor sorts
    the rows first (``_support_floor``: 16 bytes per element while it sorts); greedy-only batches hold the float32
    copy alone. Compiled, Inductor computes the probabilities where they are summed and stores none."""
    vocab_size = logits.shape[-1]
    assert vocab_size <= 2**24, "token ids travel to the host as float32, exact up to 2^24"
    scaled = logits / temperature[:, None]  # float32 (or wider) whatever came in

    def scaled_at(indices: torch.Tensor) -> torch.Tensor:
        # ``scaled`` at ``indices``, divided again where it is read: compiled, ``scaled`` is then only reduced and
        # Inductor need not store it (a gather after the search's library calls would make it).
        return logits.gather(1, indices) / temperature[:, None]

    log_support_mass = None
    if kind == GREEDY:
        tokens, log_normaliser = _argmax(scaled, normaliser=True)
    else:
        floor = None if kind == SAMPLED else _support_floor(scaled, top_k, top_p, largest_k=largest_k)
        tokens, log_normaliser, support_weight, total = _search_scaled(scaled, scaled_at, floor, uniforms)
        if floor is not None:
            # The support's share of the mass. A row that keeps every token gets log Z = 0 exactly, not the log of
            # a ratio of two float sums near 1.
            filters = (top_k > 0) | (top_p < 1)
            log_support_mass = torch.where(filters, support_weight.log() - total.log(), 0.0)
        if greedy is not None:
            tokens = torch.where(greedy, _argmax(scaled)[0], tokens)
    # The chosen token is always in the support, so both its log-probs are finite.
    chosen_log_probs = scaled_at(tokens[:, None]).squeeze(1) - log_normaliser
    sampling_log_probs = chosen_log_probs if log_support_mass is None else chosen_log_probs.double() - log_support_mass
    samples = torch.stack(
        [tokens.to(torch.float32), chosen_log_probs.to(torch.float32), sampling_log_probs.to(torch.float32)]
    )
    return tokens, samples
