"""``skinny_linear``: the few-row linear kernels against float64 under Triton's interpreter (``kernel_checks``), the
launch's splits, the fallback to ``F.linear``, the operator inside a compiled graph, and on CUDA in bfloat16 inside a
CUDA graph. The engine's use of it (``rollout.decode_matmul``) is tested in ``tests/engine/test_skinny_decode.py``."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import (
    SKINNY_INTERPRETER_CASES,
    SkinnyCase,
    check_skinny_linear,
    interpreter_unusable_reason,
    run_under_interpreter,
)

from spmd_rlhf.kernels import skinny_operators  # noqa: F401  (registers torch.ops.spmd_rlhf.skinny_*)
from spmd_rlhf.kernels.skinny_linear import (
    DEFAULT_CONFIG,
    MAX_ROWS,
    MAX_SPLITS,
    SkinnyConfig,
    config_of,
    skinny_launch,
    skinny_linear,
    skinny_norm_linear,
)
from spmd_rlhf.kernels.triton_support import triton
from spmd_rlhf.models.decoder import rms_norm


@pytest.mark.skipif(interpreter_unusable_reason() is not None, reason=str(interpreter_unusable_reason()))
def test_the_kernels_match_float64_under_the_interpreter():
    assert len(run_under_interpreter("skinny_linear")) == len(SKINNY_INTERPRETER_CASES) * 3


@pytest.mark.parametrize("config", [DEFAULT_CONFIG, SkinnyConfig(block_out=16, tile_elements=1024, tiles_per_split=2)])
def test_the_launch_covers_the_input_in_whole_tiles_with_no_empty_split(config):
    shapes = itertools.product(
        range(1, MAX_ROWS + 1), [1, 7, 511, 512, 1536, 8960, 14336, 29568], [1, 8, 1536, 17920], [8, 132]
    )
    for rows, in_features, out_features, processors in shapes:
        case = (rows, in_features, out_features, processors)
        rows_pad, block_in, splits, chunk = skinny_launch(*case, config)
        assert rows <= rows_pad < 2 * rows and rows_pad & (rows_pad - 1) == 0, case
        assert rows_pad * block_in == config.tile_elements and chunk % block_in == 0, case
        assert (splits - 1) * chunk < in_features <= splits * chunk, case
        tiles = -(-in_features // block_in)
        assert chunk == -(-tiles // splits) * block_in, case  # the splits as even as whole tiles allow
        assert splits == 1 or tiles > config.tiles_per_split, case  # a walk of a few tiles is not split
        assert splits <= MAX_SPLITS, case


@pytest.mark.parametrize(
    "fields",
    [
        dict(block_out=6),
        dict(tile_elements=2),
        dict(tiles_per_split=0),
        dict(num_warps=3),
        dict(max_rows=0),
        dict(max_rows=MAX_ROWS + 1),
    ],
)
def test_a_config_the_kernels_cannot_tile_is_refused(fields):
    with pytest.raises(ValueError, match="SkinnyConfig|tiles_per_split"):
        SkinnyConfig(**fields)


def test_a_config_travels_to_the_operators_as_its_tiling_and_back():
    config = SkinnyConfig(
        block_out=16, tile_elements=1024, tiles_per_split=2, num_warps=8, prefetch=True, dependent_launch=True
    )
    assert config_of(config.as_tiling()) == config and config_of(DEFAULT_CONFIG.as_tiling()) == DEFAULT_CONFIG


def test_the_launch_splits_a_wide_input_until_the_gpu_is_full():
    # The 1.5B shape's layers at batch 1 on 132 multiprocessors: q/k/v, o and gate/up walk 3 tiles of 512 in one
    # program per 8 outputs; down's 8,960 inputs would be 18 tiles, so 5 splits of 4 (960 programs: the 8 per
    # multiprocessor the split stops at, 192 output blocks).
    for out_features in (2048, 1536, 17920):
        assert skinny_launch(1, 1536, out_features, 132) == (1, 512, 1, 1536)
    assert skinny_launch(1, 8960, 1536, 132) == (1, 512, 5, 2048)
    assert skinny_launch(4, 8960, 1536, 132) == (4, 128, 5, 1792)
    with pytest.raises(ValueError, match="1 to 4 rows"):
        skinny_launch(MAX_ROWS + 1, 64, 64, 132)


def test_without_triton_or_past_the_row_limit_it_is_f_linear():
    x, weight, bias = torch.randn(2, 3, 16), torch.randn(5, 16), torch.randn(5)
    assert torch.equal(skinny_linear(x, weight, bias), F.linear(x, weight, bias))  # auto on CPU
    assert torch.equal(skinny_linear(x, weight, bias, backend="torch"), F.linear(x, weight, bias))
    # Six rows is past MAX_ROWS: F.linear even where Triton is asked for.
    if triton is not None:
        assert torch.equal(skinny_linear(x, weight, bias, backend="triton"), F.linear(x, weight, bias))
        # Two rows past a tiling's one (the engine's, ``decode_matmul.DEFAULT_TILINGS``): F.linear too.
        two, one_row = x[0, :2], SkinnyConfig(max_rows=1)
        assert torch.equal(
            skinny_linear(two, weight, bias, backend="triton", config=one_row), F.linear(two, weight, bias)
        )
    assert skinny_linear(torch.randn(0, 16), weight).shape == (0, 5)


@pytest.mark.parametrize(
    "x,weight,bias,message",
    [
        (torch.randn(2, 16), torch.randn(5, 15), None, "in_features"),
        (torch.randn(2, 16), torch.randn(5, 16), torch.randn(4), "bias must be"),
    ],
)
def test_shapes_are_checked(x, weight, bias, message):
    with pytest.raises(ValueError, match=message):
        skinny_linear(x, weight, bias)


@pytest.mark.skipif(triton is None, reason="needs triton")
def test_what_the_kernels_do_not_take_is_f_linear_even_where_triton_is_asked_for():
    """float64, mixed dtypes (F.linear's own error), a weight strided in its inputs, a strided bias or norm weight:
    the torch reference, no launch (on CPU outside the interpreter a launch would fail), no new error."""
    x, weight = torch.randn(2, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    assert torch.equal(skinny_linear(x, weight, backend="triton"), F.linear(x, weight))
    with pytest.raises(RuntimeError):
        skinny_linear(x.float(), weight, backend="triton")
    strided = torch.randn(16, 5).t()
    assert torch.equal(skinny_linear(x.float(), strided, backend="triton"), F.linear(x.float(), strided))
    # A strided bias or norm weight (the kernels read vectors as contiguous): the torch reference, no launch.
    x, weight, every_other = x.float(), weight.float(), torch.randn(32)[::2]
    assert torch.equal(
        skinny_linear(x, weight, every_other[:5], backend="triton"), F.linear(x, weight, every_other[:5])
    )
    h, out = skinny_norm_linear(x, every_other, 1e-6, weight, backend="triton")
    assert h is x and torch.equal(out, F.linear(rms_norm(x, every_other, 1e-6), weight))


def test_the_operator_traces_into_one_graph_with_symbolic_rows():
    """A compiled block calls the operator as one opaque call: no graph break, the row count symbolic."""
    weight, bias = torch.randn(5, 16), torch.randn(5)

    def block(x):
        return torch.ops.spmd_rlhf.skinny_linear(x.relu(), weight, bias, "auto", DEFAULT_CONFIG.as_tiling()) * 2

    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (1, 3, 9):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), F.linear(x.relu(), weight, bias) * 2, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and triton")
def test_cuda_bf16_kernels_match_float64_and_replay_in_a_cuda_graph():
    # Every case in bfloat16 (what decode runs), the plain ones in float32 too: each is a Triton compile of its own,
    # and the GPU suite gives the fast CUDA tests two minutes.
    for case in (*SKINNY_INTERPRETER_CASES, SkinnyCase(rows=1, in_features=8960, out_features=1536)):
        for dtype in (torch.float32, torch.bfloat16) if case.prologue == "plain" else (torch.bfloat16,):
            check_skinny_linear(case, dtype, "cuda", "triton")
    # The 1.5B shape's down projection at batch 1 (5 splits and their sum), captured and replayed.
    x = torch.randn(1, 8960, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1536, 8960, device="cuda", dtype=torch.bfloat16) / 95
    eager = skinny_linear(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_linear(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, skinny_linear(x, weight), rtol=0, atol=0)
    assert not torch.equal(captured, eager)
    if torch.cuda.get_device_capability() >= (9, 0):
        # Programmatic dependent launch: a chain whose second product reads the first's output (split, so each is
        # two launches), captured and replayed, equal to the same chain launched plainly.
        chained = SkinnyConfig(dependent_launch=True)
        second = torch.randn(8960, 1536, device="cuda", dtype=torch.bfloat16) / 40
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = skinny_linear(skinny_linear(x, weight, config=chained), second, config=chained)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            plain = skinny_linear(skinny_linear(x, weight), second)
            torch.testing.assert_close(captured, plain, rtol=0, atol=0)
