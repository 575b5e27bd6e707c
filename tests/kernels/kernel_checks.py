"""Checks of each Triton kernel against its float64 torch reference on fresh random inputs.

The CUDA tests call them in-process; the CPU tests run this file as a script under ``TRITON_INTERPRET=1``, which must
be set before the kernel modules are imported, so it cannot be switched on inside the pytest process:

    TRITON_INTERPRET=1 python tests/kernels/kernel_checks.py paged_attention

Every check draws a new seed and names it when it fails, so a failure can be replayed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy
import torch
import torch.nn.functional as F

from spmd_rlhf.kernels import skinny_operators  # noqa: F401  (registers torch.ops.spmd_rlhf.skinny_*)
from spmd_rlhf.kernels.fused_logprob import (
    MAX_BLOCK_VOCAB,
    fused_log_probs_and_entropy,
    reference_log_probs_and_entropy,
)
from spmd_rlhf.kernels.paged_attention import (
    DEFAULT_PAGED_CONFIG,
    PagedConfig,
    paged_decode_attention,
    reference_paged_decode_attention,
    rotate,
    write_new_tokens,
)
from spmd_rlhf.kernels.skinny_linear import (
    DEFAULT_CONFIG,
    SkinnyConfig,
    skinny_linear,
    skinny_norm_linear,
    skinny_silu_mul_linear,
)
from spmd_rlhf.kernels.triton_support import INTERPRETING, counts_left, triton, triton_available

RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""Bound on ``|out - ref| / |ref|`` (Frobenius) for outputs stored in each dtype: a few roundings of that dtype."""

FLOAT32_OUTPUT_TOLERANCE = 1e-5
"""Log-probs and entropies are float32 whatever the logits' dtype, computed from the same rounded logits as the
reference, so they get the float32 bound."""

FLOAT32_GRADIENT_TOLERANCE = 2e-5
"""The float32 gradient ``((onehot - p) / T)`` of the log-prob kernel: each ``p`` comes from a logit divided by the
temperature after its upcast, whose rounding grows with ``|logit| / T`` (rows shifted by 60 here): at T = 0.6 the
error's tail reached 1.2e-5 (once in CI, with the maximum of 200 seeded draws at 9.1e-6), past the bound of the
other float32 outputs."""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(torch.finfo(torch.float64).tiny))


@dataclass(frozen=True)
class PagedCase:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]
    strided_q: bool = False
    """q a view with a padded head stride, as a slice of a wider projection would be."""
    splits: int | None = None
    """Split-K programs per (sequence, KV head) pair; None: the wrapper's choice for the device."""
    fused_write: bool = False
    """The new token's K/V passed to the kernel (strided, as slices of the merged q/k/v projection are), which stores
    them at the last position's slot (an unlisted block's for an empty context) and attends with them."""
    rotary: bool = False
    """With the fused write: q and the new keys unrotated, with each sequence's rotary tables (rows of a wider
    table), which the kernel applies as it loads them."""
    config: PagedConfig = DEFAULT_PAGED_CONFIG
    """The kernel's tiling."""


def check_paged_attention(case: PagedCase, dtype: torch.dtype, device: str, backend: str) -> float:
    """Runs ``paged_decode_attention`` on random inputs laid out like the engine's cache; returns its relative error."""
    seed = torch.seed()
    num_seqs = len(case.context_lens)
    blocks_per_seq = [math.ceil(length / case.block_size) for length in case.context_lens]
    # One spare column of padding in every table (as the engine pads to the longest sequence) and spare blocks that
    # no table lists, so that reading a wrong block changes the result.
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    for seq, count in enumerate(blocks_per_seq):
        block_tables[seq, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    cache_shape = (num_blocks, case.block_size, case.kv_heads, case.head_dim)
    key_cache = torch.randn(cache_shape, device=device).to(dtype)
    value_cache = torch.randn(cache_shape, device=device).to(dtype)
    padding = 8 if case.strided_q else 0
    q = (torch.randn(num_seqs, case.heads, case.head_dim + padding, device=device) * 2).to(dtype)[..., : case.head_dim]
    context_lens = torch.tensor(case.context_lens, dtype=torch.int32, device=device)
    block_tables = block_tables.to(device)
    scale = case.head_dim**-0.5

    new_tokens, expected_caches, attended_q = {}, (key_cache, value_cache), q
    if case.fused_write:
        new_tokens = _new_tokens(case, block_tables, num_blocks - 1, dtype, device)
        stored_keys = new_tokens["new_keys"]
        if case.rotary:
            new_tokens["rope"] = _rotary_tables(case, dtype, device)
            attended_q, stored_keys = rotate(q, *new_tokens["rope"]), rotate(stored_keys, *new_tokens["rope"])
        # The slots hold stale random values, so attending over the cache instead of the new token fails.
        expected_caches = tuple(cache.clone() for cache in (key_cache, value_cache))
        write_new_tokens(*expected_caches, stored_keys, new_tokens["new_values"], new_tokens["slots"])
    launches = 2 if case.splits is not None or device == "cuda" else 1  # the interpreter is slow: its split cases
    outs = [
        paged_decode_attention(
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            scale=scale,
            backend=backend,
            splits=case.splits,
            config=case.config,
            **new_tokens,
        )
        for _ in range(launches)
    ]
    # With split-K, a second launch equal to the first, and every pair's arrival count back at 0: the last program
    # to finish combines (``PagedConfig.last_combines``) only where the counts start from 0.
    out = outs[0]
    assert torch.equal(outs[-1], out), f"{case} {dtype} seed {seed}: a second launch differs"
    assert not counts_left(q.device), f"{case}: arrival counts left"
    expected = reference_paged_decode_attention(
        attended_q.double(), *(cache.double() for cache in expected_caches), block_tables, context_lens, scale=scale
    )
    assert out.shape == q.shape and out.dtype == dtype, f"{case}: got {out.dtype} {list(out.shape)}"
    for name, cache, expected_cache in zip(("key", "value"), (key_cache, value_cache), expected_caches, strict=True):
        if case.rotary and device == "cuda":
            # Compiled, the rotation's multiply and add may contract into one FMA: a last-bit difference at most.
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(cache, expected_cache, rtol=eps, atol=4 * eps, msg=f"{case} seed {seed}")
        else:
            assert torch.equal(cache, expected_cache), f"{case} {dtype} seed {seed}: the {name} cache was written wrong"
    empty = context_lens == 0
    assert not out[empty].any(), f"{case} seed {seed}: a sequence with no context must get zeros"
    error = relative_error(out[~empty], expected[~empty])
    assert error < RELATIVE_TOLERANCE[dtype], f"{case} {dtype} seed {seed}: relative error {error:.2e}"
    return error


def _new_tokens(
    case: PagedCase, block_tables: torch.Tensor, spare_block: int, dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    """Each sequence's new token for the fused write: K/V views of wider rows, and the slot of position
    ``context_len - 1`` (for an empty context, a slot of ``spare_block``, which no table lists)."""
    slots = []
    for seq, length in enumerate(case.context_lens):
        last = length - 1
        block = int(block_tables[seq, last // case.block_size]) if length else spare_block
        slots.append(block * case.block_size + (last % case.block_size if length else 0))
    num_seqs = len(case.context_lens)
    wide = torch.randn(num_seqs, case.kv_heads, 2, case.head_dim + 8, device=device).to(dtype)
    return {
        "new_keys": wide[:, :, 0, : case.head_dim],
        "new_values": wide[:, :, 1, : case.head_dim],
        "slots": torch.tensor(slots, dtype=torch.int64, device=device),
    }


def _rotary_tables(case: PagedCase, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's cos and sin at its new position (rotate-half layout, theta 10,000), as rows of one
    ``[num_seqs, 2, head_dim]`` table (strided, as the kernel must take them)."""
    positions = torch.tensor([max(length - 1, 0) for length in case.context_lens], dtype=torch.float32)
    inverse = 10000.0 ** -(torch.arange(0, case.head_dim, 2, dtype=torch.float32) / case.head_dim)
    angles = positions[:, None] * inverse
    angles = torch.cat((angles, angles), dim=-1)
    table = torch.stack((angles.cos(), angles.sin()), dim=1).to(device=device, dtype=dtype)
    return table[:, 0], table[:, 1]


@dataclass(frozen=True)
class LogProbCase:
    tokens: int
    vocab: int
    strided_rows: bool = False
    """logits a slice of wider rows, as the response positions of a longer sequence are."""
    int32_labels: bool = False
    temperature: float = 1.0
    """Log-probs of ``softmax(logits / temperature)``; the kernels scale the logits as they read them."""


def check_log_probs_and_entropy(case: LogProbCase, dtype: torch.dtype, device: str, backend: str) -> dict[str, float]:
    """Values and gradient of ``fused_log_probs_and_entropy`` on random logits; returns the relative errors."""
    seed = torch.seed()
    padding = 5 if case.strided_rows else 0
    wide = torch.randn(case.tokens, case.vocab + padding, device=device) * 4
    # Half the rows peak in the last vocabulary block, so the online max changes mid-row; every third row is shifted
    # far from zero, where entropy = lse - mean logit would lose digits to cancellation.
    wide[: case.tokens // 2, case.vocab - max(1, case.vocab // 10) : case.vocab] += 8
    wide[1::3] += 60
    logits = wide.to(dtype)[:, : case.vocab]
    labels = torch.randint(0, case.vocab, (case.tokens,), device=device)
    labels = labels.int() if case.int32_labels else labels
    # A plain sum reaches backward as an expanded (stride 0) gradient, a weighted one as a real tensor: both occur.
    grad_log_probs, entropy_weight = torch.randn(case.tokens, device=device), float(torch.randn(()))

    leaf = logits.detach().requires_grad_()
    log_probs, entropy = fused_log_probs_and_entropy(leaf, labels, temperature=case.temperature, backend=backend)
    (grad,) = torch.autograd.grad((log_probs * grad_log_probs).sum() + entropy.sum() * entropy_weight, leaf)
    reference_leaf = logits.detach().double().requires_grad_()
    expected_log_probs, expected_entropy = reference_log_probs_and_entropy(
        reference_leaf, labels, temperature=case.temperature
    )
    loss = (expected_log_probs * grad_log_probs.double()).sum() + expected_entropy.sum() * entropy_weight
    (expected_grad,) = torch.autograd.grad(loss, reference_leaf)

    assert log_probs.dtype == entropy.dtype == torch.float32 and grad.dtype == dtype
    errors = {
        "log_probs": relative_error(log_probs, expected_log_probs),
        "entropy": relative_error(entropy, expected_entropy),
        "grad": relative_error(grad, expected_grad),
    }
    bounds = {
        "log_probs": FLOAT32_OUTPUT_TOLERANCE,
        "entropy": FLOAT32_OUTPUT_TOLERANCE,
        "grad": FLOAT32_GRADIENT_TOLERANCE if dtype == torch.float32 else RELATIVE_TOLERANCE[dtype],
    }
    for name, error in errors.items():
        assert error < bounds[name], f"{case} {dtype} seed {seed}: {name} relative error {error:.2e}"
    return errors


def check_out_of_range_label_gives_nan(device: str) -> None:
    """The Triton path cannot raise for a bad label without waiting for the device; it must not read out of bounds
    and return a plausible number instead."""
    logits = torch.randn(3, 40, device=device)
    labels = torch.tensor([40, -1, 7], device=device)
    log_probs, entropy = fused_log_probs_and_entropy(logits, labels, backend="triton")
    assert log_probs[:2].isnan().all() and log_probs[2].isfinite() and entropy.isfinite().all(), log_probs


@dataclass(frozen=True)
class SkinnyCase:
    rows: int
    in_features: int
    out_features: int
    bias: bool = True
    splits: int | None = None
    leading: tuple[int, ...] | None = None
    """``x``'s leading dimensions (their product is ``rows``); None: ``(rows,)``."""
    strided_x: bool = False
    prologue: str = "plain"
    """What the kernel computes its input from: ``plain`` (``x``), ``norm`` (``rms_norm(x)``), ``residual_norm``
    (``rms_norm(x + residual)``, and that sum) or ``silu_mul`` (``silu(gate) * up`` of ``x = [gate, up]``)."""
    config: SkinnyConfig = DEFAULT_CONFIG


NORM_EPS = 1e-6


def _round_as_the_kernel(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``values`` rounded to ``dtype`` as the kernel rounds them: to nearest even, as torch does, except that
    Triton's interpreter rounds float32 to bfloat16 toward zero (a GPU to nearest even), a bias of half a unit in
    the last place that SwiGLU's two roundings would carry into every product."""
    if dtype == torch.bfloat16 and INTERPRETING:
        return (values.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # the low 16 bits dropped: exact
    return values.to(dtype)


def _skinny_reference(case: SkinnyCase, x, residual, norm_weight, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the float64 input of the product, the float64 product)``; the input's elementwise ops rounded to the dtype
    where the model rounds them (the residual add, SwiGLU's silu and product), the norm in float64."""
    if case.prologue == "silu_mul":
        gate, up = (half.float() for half in x.chunk(2, dim=-1))
        inputs = _round_as_the_kernel(_round_as_the_kernel(F.silu(gate), x.dtype).float() * up, x.dtype).double()
    elif case.prologue == "plain":
        inputs = x.double()
    else:
        h = (x if residual is None else _round_as_the_kernel(x.float() + residual.float(), x.dtype)).double()
        inputs = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS) * norm_weight.double()
    return inputs, F.linear(inputs, weight.double(), None if bias is None else bias.double())


def _run_skinny(case: SkinnyCase, x, residual, norm_weight, weight, bias, backend: str, *, through_op: bool):
    """``(the product, h or None)`` from the function of ``case.prologue``, or from its operator."""
    tiling = case.config.as_tiling()
    if case.prologue == "plain":
        if through_op:
            return torch.ops.spmd_rlhf.skinny_linear(x, weight, bias, backend, tiling), None
        return skinny_linear(x, weight, bias, backend=backend, splits=case.splits, config=case.config), None
    if case.prologue == "silu_mul":
        if through_op:
            return torch.ops.spmd_rlhf.skinny_silu_mul_linear(x, weight, bias, backend, tiling), None
        return (
            skinny_silu_mul_linear(x, weight, bias, backend=backend, splits=case.splits, config=case.config),
            None,
        )
    if through_op and residual is None:
        return torch.ops.spmd_rlhf.skinny_norm_linear(x, norm_weight, NORM_EPS, weight, bias, backend, tiling), None
    if through_op:
        h, out = torch.ops.spmd_rlhf.skinny_residual_norm_linear(
            x, residual, norm_weight, NORM_EPS, weight, bias, backend, tiling
        )
        return out, h
    h, out = skinny_norm_linear(
        x,
        norm_weight,
        NORM_EPS,
        weight,
        bias,
        residual=residual,
        backend=backend,
        splits=case.splits,
        config=case.config,
    )
    assert residual is not None or h is x, "without a residual, h is x itself"
    return out, None if residual is None else h


def check_skinny_linear(case: SkinnyCase, dtype: torch.dtype, device: str, backend: str) -> float:
    """Runs ``case.prologue``'s skinny-linear function and its operator on random inputs; returns its relative error
    against float64 (and checks the residual sum it returns, which must equal the model's add exactly)."""
    seed = torch.seed()
    padding = 8 if case.strided_x else 0
    width = 2 * case.in_features if case.prologue == "silu_mul" else case.in_features
    x = torch.randn(*(case.leading or (case.rows,)), width + padding, device=device)
    x = (x * 3).to(dtype)[..., :width]  # rms well away from 1, so a norm left out shows
    residual = torch.randn(x.shape, device=device).to(dtype) if case.prologue == "residual_norm" else None
    norm_weight = (torch.rand(case.in_features, device=device) + 0.5).to(dtype) if "norm" in case.prologue else None
    weight = (torch.randn(case.out_features, case.in_features, device=device) / case.in_features**0.5).to(dtype)
    bias = torch.randn(case.out_features, device=device).to(dtype) if case.bias else None
    tensors = (x, residual, norm_weight, weight, bias)
    out, h = _run_skinny(case, *tensors, backend, through_op=False)
    if case.splits is not None or device == "cuda":
        # A second launch equal to the first, every arrival count back at 0 (the split sum by the last program).
        assert torch.equal(_run_skinny(case, *tensors, backend, through_op=False)[0], out), f"{case}: a second launch"
        assert not counts_left(x.device), f"{case}: arrival counts left"
    _, expected = _skinny_reference(case, *tensors)
    assert out.shape == expected.shape and out.dtype == dtype, f"{case}: {out.dtype} {list(out.shape)}"
    error = relative_error(out, expected)
    assert error < RELATIVE_TOLERANCE[dtype], f"seed {seed}: {case} {dtype} relative error {error:.2e}"
    if residual is not None:
        expected_h = _round_as_the_kernel(x.float() + residual.float(), dtype)  # the model's add (x + residual)
        assert torch.equal(h, expected_h), f"seed {seed}: {case} {dtype}: h is not the model's x + residual"
    if case.splits is None:
        through_op, h_through_op = _run_skinny(case, *tensors, backend, through_op=True)
        assert torch.equal(through_op, out), f"seed {seed}: {case} {dtype}: the operator differs from the function"
        assert h is None or torch.equal(h_through_op, h), f"seed {seed}: {case} {dtype}: the operator's h differs"
    return error


SKINNY_INTERPRETER_CASES = [
    SkinnyCase(rows=1, in_features=100, out_features=37),
    SkinnyCase(rows=2, in_features=600, out_features=20, bias=False, strided_x=True),
    SkinnyCase(rows=3, in_features=1100, out_features=19, splits=3),
    SkinnyCase(rows=4, in_features=5000, out_features=9, leading=(2, 2)),
    SkinnyCase(rows=1, in_features=2000, out_features=8, bias=False, splits=2),
    SkinnyCase(rows=1, in_features=700, out_features=37, prologue="norm"),
    SkinnyCase(rows=3, in_features=1100, out_features=19, prologue="norm", splits=3, strided_x=True),
    SkinnyCase(rows=2, in_features=600, out_features=20, prologue="residual_norm", leading=(2, 1)),
    SkinnyCase(rows=4, in_features=1700, out_features=11, bias=False, prologue="residual_norm", splits=4),
    SkinnyCase(rows=1, in_features=300, out_features=24, prologue="silu_mul"),
    SkinnyCase(rows=3, in_features=1300, out_features=10, bias=False, prologue="silu_mul", splits=3),
    SkinnyCase(
        rows=2,
        in_features=900,
        out_features=40,
        prologue="residual_norm",
        config=SkinnyConfig(block_out=16, tile_elements=256, tiles_per_split=1, num_warps=2),
    ),
    SkinnyCase(rows=1, in_features=2100, out_features=13, config=SkinnyConfig(prefetch=True)),
    SkinnyCase(
        rows=3,
        in_features=1700,
        out_features=11,
        prologue="residual_norm",
        splits=2,
        config=SkinnyConfig(prefetch=True),
    ),
    SkinnyCase(rows=2, in_features=1300, out_features=10, prologue="silu_mul", config=SkinnyConfig(prefetch=True)),
    SkinnyCase(rows=1, in_features=1300, out_features=10, splits=3, config=SkinnyConfig(last_sums=False)),
]
"""One row to ``MAX_ROWS`` (padded to 1, 2, 4 and 4), widths that are not multiples of the tiles, with and without a
bias, a strided and a three-dimensional ``x``; split inputs as asked (3 splits of 1,100 features) and as
``skinny_launch`` picks them (5,000 features over the interpreter's 8 multiprocessors: 14 splits of 384), and two
splits whose last is short; then each prologue (the norm, the norm of a residual sum, SwiGLU's activation) in one
program per output block and split (the norm's ``1 / rms`` then applied by ``sum_splits_kernel``); and a tiling
other than the default (``SkinnyConfig``: 16 outputs per program, tiles of 128 inputs, split at once), each
prologue with the next tile's loads issued a tile ahead (``prefetch``: 5, 4 and 6 tiles per program), and split
products summed by ``sum_splits_kernel`` rather than each block's last program (``last_sums`` off). A split plain or
SwiGLU product is summed by its output block's last program to finish (the default)."""


PAGED_INTERPRETER_CASES = [
    PagedCase(heads=8, kv_heads=2, head_dim=16, block_size=4, context_lens=(1, 37, 130)),
    PagedCase(heads=6, kv_heads=2, head_dim=24, block_size=5, context_lens=(0, 9, 70), strided_q=True),
    PagedCase(heads=4, kv_heads=4, head_dim=32, block_size=16, context_lens=(200, 3)),
    PagedCase(heads=8, kv_heads=2, head_dim=16, block_size=4, context_lens=(1, 37, 300), splits=3),
    PagedCase(heads=6, kv_heads=2, head_dim=24, block_size=5, context_lens=(0, 9, 70), strided_q=True, splits=4),
    PagedCase(heads=8, kv_heads=2, head_dim=16, block_size=4, context_lens=(0, 1, 64, 65, 130), fused_write=True),
    PagedCase(heads=6, kv_heads=2, head_dim=24, block_size=5, context_lens=(0, 9, 70), splits=4, fused_write=True),
    PagedCase(
        heads=8, kv_heads=2, head_dim=16, block_size=4, context_lens=(0, 1, 65, 130), fused_write=True, rotary=True
    ),
    PagedCase(
        heads=6,
        kv_heads=2,
        head_dim=24,
        block_size=5,
        context_lens=(3, 9, 70),
        strided_q=True,
        splits=4,
        fused_write=True,
        rotary=True,
    ),
    PagedCase(
        heads=8,
        kv_heads=2,
        head_dim=16,
        block_size=4,
        context_lens=(0, 1, 33, 130),
        splits=3,
        fused_write=True,
        rotary=True,
        config=PagedConfig(block_tokens=32, num_warps=2),
    ),
    PagedCase(
        heads=6,
        kv_heads=2,
        head_dim=24,
        block_size=5,
        context_lens=(0, 9, 70),
        splits=4,
        fused_write=True,
        config=PagedConfig(last_combines=False),
    ),
]
"""Small shapes covering several context tiles, padded GQA groups and head dims, block sizes that are not powers of
two, an empty context, plain multi-head attention and a strided ``q``; split-K over 3 and 4 programs per pair, with
splits left empty by short and empty contexts (the first three take the wrapper's choice: one program per pair, the
interpreter's device counting 8 multiprocessors); the fused K/V write with the last position first, last and inside a
tile, with and without split-K; and with it the fused rotation (a head dim whose half is not a power of two, split-K
and a strided ``q``); a tiling other than the default's (``PagedConfig``: 32-token tiles, the last position
first in its tile and a context ending mid-tile); and split-K's combine as a kernel of its own (``last_combines``
off)."""

PAGED_INTERPRETER_DTYPES = (torch.float32, torch.float16)
"""Triton's interpreter multiplies bfloat16 ``tl.dot`` operands as raw integers, so bfloat16 is checked on CUDA only."""

LOG_PROB_INTERPRETER_CASES = [
    LogProbCase(tokens=6, vocab=MAX_BLOCK_VOCAB + 904),
    LogProbCase(tokens=4, vocab=MAX_BLOCK_VOCAB + 300, temperature=0.6),
    LogProbCase(tokens=5, vocab=37, strided_rows=True, int32_labels=True, temperature=1.7),
    LogProbCase(tokens=0, vocab=37),
]
"""Rows longer than one vocabulary block (the online max rescales), also sharpened by a temperature below 1, a short
vocabulary that is not a power of two with strided rows, int32 labels and a temperature above 1, and no tokens."""


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed triton; (0, 0) without it."""
    return _major_minor(triton.__version__) if triton_available() else (0, 0)


def interpreter_unusable_reason() -> str | None:
    """Why Triton's CPU interpreter cannot run the kernels here, or None when it can."""
    if not triton_available():
        return "triton is not installed"
    if triton_version() < (3, 7) and _major_minor(numpy.__version__) >= (2, 4):
        return "Triton < 3.7's interpreter cannot run loops with run-time bounds under numpy >= 2.4 (triton#9171)"
    return None


def run_under_interpreter(kernel: str) -> list[str]:
    """Runs this file's checks of ``kernel`` in a subprocess under the interpreter; returns the ``ok`` lines."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, __file__, kernel], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"interpreted {kernel} checks failed:\n{result.stderr[-6000:]}"
    return [line for line in result.stdout.splitlines() if line.startswith("ok ")]


def _run_interpreted(kernel: str) -> None:
    """Prints one ``ok`` line per passed check (the test counts them)."""
    if kernel == "paged_attention":
        for case in PAGED_INTERPRETER_CASES:
            for dtype in PAGED_INTERPRETER_DTYPES:
                print("ok", case, dtype, f"{check_paged_attention(case, dtype, 'cpu', 'triton'):.1e}")
    elif kernel == "fused_logprob":
        for case in LOG_PROB_INTERPRETER_CASES:
            for dtype in RELATIVE_TOLERANCE:
                print("ok", case, dtype, check_log_probs_and_entropy(case, dtype, "cpu", "triton"))
        check_out_of_range_label_gives_nan("cpu")
        print("ok out-of-range label")
    elif kernel == "skinny_linear":
        for case in SKINNY_INTERPRETER_CASES:
            for dtype in RELATIVE_TOLERANCE:
                print("ok", case, dtype, f"{check_skinny_linear(case, dtype, 'cpu', 'triton'):.1e}")
    else:
        raise SystemExit(f"unknown kernel {kernel!r}; choose paged_attention, fused_logprob or skinny_linear")


if __name__ == "__main__":
    _run_interpreted(sys.argv[1])
