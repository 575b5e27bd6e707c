"""``benchmarks/kernel_resources.py``: the engine's kernel launches recorded on CPU and specialised as Triton's JIT
specialises them, then compiled for sm_90 without a GPU: the paged decode kernel's walk is pipelined through
asynchronous copies with 16-byte loads and no spill, which a compile without the JIT's marks does not show."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gpu_paged_sweep import engine_call  # noqa: E402
from kernel_resources import compile_and_count, launches_of, specialise  # noqa: E402

from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig  # noqa: E402
from spmd_rlhf.kernels.triton_support import INTERPRETING, triton  # noqa: E402


def _triton_version() -> tuple[int, int]:
    return tuple(int(part) for part in triton.__version__.split(".")[:2]) if triton is not None else (0, 0)


needs_compiler = pytest.mark.skipif(
    triton is None or INTERPRETING or _triton_version() < (3, 5),
    reason="needs triton >= 3.5 (ASTSource by argument name, a bundled ptxas), not in interpreter mode",
)


@needs_compiler
def test_a_decode_steps_launches_are_specialised_as_the_jit_would():
    launches = launches_of(lambda: engine_call(1, 256, "cpu", torch.bfloat16)(DEFAULT_PAGED_CONFIG))
    assert [kernel.__name__ for kernel, _, _ in launches] == ["paged_decode_kernel"]  # split-K, combined inside
    separate = PagedConfig(last_combines=False)
    combined_apart = launches_of(lambda: engine_call(1, 256, "cpu", torch.bfloat16)(separate))
    assert [kernel.__name__ for kernel, _, _ in combined_apart] == ["paged_decode_kernel", "combine_splits_kernel"]
    kernel, args, kwargs = launches[0]
    signature, constexprs, attrs, options = specialise(kernel, args, kwargs)
    assert options == {"num_warps": 4, "num_stages": 3}
    assert signature["key_cache_ptr"] == "*bf16" and signature["block_tables_ptr"] == "*i32"
    assert signature["stride_key_token"] == "i32" and signature["scale_log2"] == "fp32"
    assert constexprs["BLOCK_TOKENS"] == 64 and constexprs["FUSED_WRITE"] is True
    index = kernel.arg_names.index
    # The key cache's token stride (4 KV heads x 128) is divisible by 16; the table's block stride is 1, a constant.
    assert attrs[(index("stride_key_token"),)] == [["tt.divisibility", 16]]
    assert signature["stride_table_block"] == "constexpr" and constexprs["stride_table_block"] == 1
    assert (index("key_cache_ptr"),) in attrs


@needs_compiler
def test_the_paged_kernels_walk_is_pipelined_with_wide_loads_and_no_spill():
    [(kernel, args, kwargs)] = launches_of(lambda: engine_call(1, 256, "cpu", torch.bfloat16)(DEFAULT_PAGED_CONFIG))
    counted = compile_and_count(kernel, args, kwargs, 90)
    assert counted["spill_store_bytes"] == 0 and 0 < counted["registers"] <= 255
    assert counted["async_copies"] > 0 and counted["global_loads_16_byte"] > 0
    unpipelined = compile_and_count(kernel, args, kwargs | {"num_stages": 1}, 90)
    assert unpipelined["async_copies"] == 0
