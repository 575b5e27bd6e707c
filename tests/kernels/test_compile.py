"""Every kernel compiles to a Hopper (sm_90) binary without a GPU, for each dtype it accepts.

The interpreter runs the kernels' Python semantics but not Triton's compiler, whose type rules are stricter
(loop-carried types, dot operand dtypes and shapes); compiling ahead of time catches those on a machine without CUDA.
"""

from __future__ import annotations

import pytest
from kernel_checks import triton_version

from spmd_rlhf.kernels import fused_logprob, paged_attention, paged_attention_programs, skinny_linear_programs
from spmd_rlhf.kernels.triton_support import INTERPRETING, triton

pytestmark = pytest.mark.skipif(
    triton is None or INTERPRETING or triton_version() < (3, 5),
    reason="needs triton >= 3.5 (its ASTSource signature by argument name), not in interpreter mode",
)

DTYPES = ("fp32", "fp16", "bf16")


def _compile(kernel, pointers: dict[str, str], constexprs: dict, *, floats: tuple[str, ...] = (), num_warps: int = 4):
    """Compiles ``kernel`` with the given pointer types; every other argument is an i32 (or fp32 if in ``floats``).
    ``constexprs`` without ``DEPENDENT_LAUNCH`` (a parameter of the decode kernels) get it off; with it on, the
    launch option too, and the PTX must wait for the kernel before before anything else."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {"num_warps": num_warps}
    if "DEPENDENT_LAUNCH" in kernel.arg_names:
        constexprs = {"DEPENDENT_LAUNCH": False} | constexprs
        options |= {"launch_pdl": True} if constexprs["DEPENDENT_LAUNCH"] else {}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in floats else "i32")
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
    )
    assert compiled.asm["cubin"], "ptxas produced no binary"
    waits = compiled.asm["ptx"].count("griddepcontrol.wait")
    assert waits == (1 if constexprs.get("DEPENDENT_LAUNCH") else 0), waits
    if waits:
        body = compiled.asm["ptx"].split("griddepcontrol.wait")[0]
        assert "ld.global" not in body and "st.global" not in body and "cp.async" not in body, "memory before the wait"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "splits,fused_write,rotary,block_tokens,dependent_launch",
    [
        (1, False, False, paged_attention.BLOCK_TOKENS, False),
        (8, False, False, paged_attention.BLOCK_TOKENS, False),
        (1, True, False, paged_attention.BLOCK_TOKENS, False),
        (8, True, False, paged_attention.BLOCK_TOKENS, False),
        (8, True, True, paged_attention.BLOCK_TOKENS, False),
        (8, True, True, paged_attention.BLOCK_TOKENS, True),
        (1, True, True, 32, False),
        (1, True, True, 128, False),
    ],
)
def test_paged_decode_kernel_compiles(dtype, splits, fused_write, rotary, block_tokens, dependent_launch):
    # Without the rotation the wrapper passes q as the (unread) tables.
    tensors = ("out_ptr", "q_ptr", "key_cache_ptr", "value_cache_ptr", "new_keys_ptr", "new_values_ptr")
    tensors += ("cos_ptr", "sin_ptr")
    pointers = {name: f"*{dtype}" for name in tensors}
    # Without the fused write the wrapper passes the context lengths as the (unread) slots.
    pointers |= {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "slots_ptr": "*i64" if fused_write else "*i32"}
    pointers |= {"arrivals_ptr": "*i32"}  # split-K's arrival counts (the context lengths, unread, without split-K)
    pointers |= {name: "*fp32" for name in ("partial_out_ptr", "partial_max_ptr", "partial_sum_ptr")}
    shapes = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=64, HEAD_DIM_PAD=64, SPLITS=splits)
    constexprs = dict(
        shapes,
        BLOCK_TOKENS=block_tokens,
        LAST_COMBINES=splits > 1,  # the default's; the combine kernel of its own below
        FUSED_WRITE=fused_write,
        ROTARY=rotary,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
        DEPENDENT_LAUNCH=dependent_launch,
    )
    _compile(paged_attention_programs.paged_decode_kernel, pointers, constexprs, floats=("scale_log2",))
    if splits > 1:
        _compile(
            paged_attention_programs.combine_splits_kernel, pointers, shapes | {"DEPENDENT_LAUNCH": dependent_launch}
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_kernels_compile(dtype):
    constexprs = dict(BLOCK_VOCAB=fused_logprob.MAX_BLOCK_VOCAB)
    statistics = {name: "*fp32" for name in ("log_probs_ptr", "entropy_ptr", "logsumexp_ptr")}
    forward = statistics | {"logits_ptr": f"*{dtype}", "labels_ptr": "*i64"}
    _compile(fused_logprob._forward_kernel, forward, constexprs, num_warps=8)
    backward = statistics | {
        "grad_logits_ptr": f"*{dtype}",
        "logits_ptr": f"*{dtype}",
        "labels_ptr": "*i64",
        "grad_log_probs_ptr": "*fp32",
        "grad_entropy_ptr": "*fp32",
    }
    _compile(fused_logprob._backward_kernel, backward, constexprs, num_warps=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows_pad,splits,bias,prologue,residual,prefetch,dependent_launch",
    [
        (1, 1, True, "PLAIN", False, False, False),
        (1, 5, False, "PLAIN", False, True, False),
        (4, 5, True, "PLAIN", False, False, False),
        (2, 1, False, "PLAIN", False, False, False),
        (1, 1, True, "NORM", True, False, False),
        (1, 1, True, "NORM", True, True, False),
        (4, 5, False, "NORM", True, False, False),
        (4, 5, False, "NORM", True, False, True),
        (2, 1, False, "NORM", False, False, False),
        (1, 5, True, "SILU_MUL", False, False, False),
        (1, 5, True, "SILU_MUL", False, False, True),
        (4, 1, False, "SILU_MUL", False, True, False),
    ],
)
def test_skinny_linear_kernels_compile(dtype, rows_pad, splits, bias, prologue, residual, prefetch, dependent_launch):
    tensors = ("out_ptr", "x_ptr", "residual_ptr", "h_ptr", "norm_ptr", "weight_ptr", "bias_ptr", "normed_ptr")
    pointers = {name: f"*{dtype}" for name in tensors} | {"partial_ptr": "*fp32", "arrivals_ptr": "*i32"}
    shapes = dict(ROWS_PAD=rows_pad, SPLITS=splits, HAS_BIAS=bias)
    kind = getattr(skinny_linear_programs, prologue).value
    last_sums = splits > 1 and prologue != "NORM"  # the default's: the split sum by the last program to finish
    constexprs = dict(shapes, BLOCK_OUT=8, BLOCK_IN=512 // rows_pad, INPUT=kind, HAS_RESIDUAL=residual)
    constexprs |= dict(PREFETCH=prefetch, LAST_SUMS=last_sums, DEPENDENT_LAUNCH=dependent_launch)
    _compile(skinny_linear_programs.skinny_linear_kernel, pointers, constexprs, floats=("eps",))
    if splits > 1:
        constexprs = dict(shapes, BLOCK_OUT=256, NORMED=prologue == "NORM", BLOCK_NORM=256)
        constexprs |= dict(DEPENDENT_LAUNCH=dependent_launch)
        _compile(skinny_linear_programs.sum_splits_kernel, pointers, constexprs, floats=("eps",))
