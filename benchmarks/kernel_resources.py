"""Registers, spills, shared memory and asynchronous copies of the decode kernels compiled for a Hopper GPU on a
machine without one, as Triton's JIT would compile the engine's own launches:

    python benchmarks/kernel_resources.py [--arch 90]     # about a minute of compiling on CPU; needs triton >= 3.5

Each tiling the GPU sweeps time (``gpu_paged_sweep.SWEEP``, ``gpu_skinny_sweep.SWEEP``) is launched as the engine
launches it (``gpu_paged_sweep.engine_call`` at batch 1 with split-K and at batch 256 without;
``gpu_skinny.engine_projection`` for each projection of the 1.5B shape at one row), on CPU tensors, with the kernels
replaced by recorders; each recorded launch is then compiled ahead of time with the specialisation the JIT gives its
arguments (16-byte-aligned pointers and integers divisible by 16 marked so, integers equal to 1 made constants),
and ptxas reports its registers and spills. Why it matters: compiled without those marks, the paged kernel's K/V
loads are 2-byte scalar loads, its loop is not pipelined and its default tiling seems to spill (session 45's reading,
since corrected); with them, as on a GPU, the loads are 16 bytes wide, the walk's loads are asynchronous copies
(``cp.async``) pipelined ``num_stages`` deep, and nothing spills. Writes
``benchmarks/results/kernel_resources_sm<arch>_triton<version>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict

import torch
from gpu_common import write_result
from gpu_paged_sweep import SWEEP as PAGED_SWEEP
from gpu_paged_sweep import engine_call
from gpu_skinny import SKINNY_SHAPES, engine_projection
from gpu_skinny_sweep import SWEEP as SKINNY_SWEEP

from spmd_rlhf.kernels import paged_attention, skinny_linear
from spmd_rlhf.kernels.triton_support import triton

POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
MULTIPROCESSORS = 132
"""An H100 SXM's or an H200's: the wrappers size their split-K launches by it."""


@contextlib.contextmanager
def recorded_launches(launches: list) -> Iterator[None]:
    """The paged-attention and skinny-linear wrappers launch nothing while inside: each launch (its kernel, the
    arguments and the launch options) is appended to ``launches``, on any device."""

    class Recorder:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    names = {
        paged_attention: ("paged_decode_kernel", "combine_splits_kernel"),
        skinny_linear: ("skinny_linear_kernel", "sum_splits_kernel"),
    }
    saved = {(module, name): getattr(module, name) for module, kernels in names.items() for name in kernels}
    saved |= {(module, name): getattr(module, name) for module in names for name in ("use_triton", "multiprocessors")}
    try:
        for (module, name), kernel in saved.items():
            if name.endswith("_kernel"):
                setattr(module, name, Recorder(kernel))
        for module in names:
            module.use_triton = lambda device, backend: True
            module.multiprocessors = lambda device: MULTIPROCESSORS
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def specialise(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """``(signature, constexprs, attrs, options)`` of one launch as Triton's JIT specialises it: tensors as typed
    pointers, 16-byte-aligned ones marked divisible by 16; integers as i32 / i64, those divisible by 16 marked so
    and those equal to 1 made constants; floats as fp32; constexpr parameters as given. ``options``: the launch's
    ``num_warps`` / ``num_stages``."""
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        divisible = False
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], divisible = POINTER_TYPES[value.dtype], value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name], divisible = ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {name} is a {type(value).__name__}")
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def compile_and_count(kernel, args: tuple, kwargs: dict, arch: int) -> dict:
    """One launch compiled for ``sm_<arch>``: registers and spill bytes (ptxas), shared memory, and the PTX's
    asynchronous copies and 16-byte global loads."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialise(kernel, args, kwargs)
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options
    )
    ptx = compiled.asm["ptx"]
    ptxas = get_ptxas(arch).path  # the one Triton itself runs for this architecture
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        report = subprocess.run(
            [ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
    return {
        "kernel": kernel.__name__,
        "num_warps": options.get("num_warps", 4),
        "num_stages": options.get("num_stages", 3),
        "registers": int(re.search(r"Used (\d+) registers", report).group(1)),
        "spill_store_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1)),
        "shared_bytes": compiled.metadata.shared,
        "async_copies": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "global_loads_16_byte": len(re.findall(r"ld\.global[\w.]*\.v4\.b32", ptx)),
        "global_loads": len(re.findall(r"ld\.global", ptx)),
    }


def launches_of(call) -> list:
    launches: list = []
    with recorded_launches(launches), torch.inference_mode():
        call()
    return launches


def measure(arch: int) -> list[dict]:
    rows = []
    for regime, (seqs, context) in {"batch1_256": (1, 256), "batch256_1024": (256, 1024)}.items():
        call = engine_call(seqs, context, "cpu", torch.bfloat16)
        for index, config in enumerate(PAGED_SWEEP):
            for kernel, args, kwargs in launches_of(lambda: call(config)):
                rows.append(
                    {
                        "sweep": "paged",
                        "regime": regime,
                        "config": index,
                        **compile_and_count(kernel, args, kwargs, arch),
                    }
                )
    for name, (in_features, out_features, has_bias) in SKINNY_SHAPES["1.5b"].items():
        x = torch.empty(1, in_features, dtype=torch.bfloat16)
        weight = torch.empty(out_features, in_features, dtype=torch.bfloat16)
        bias = torch.empty(out_features, dtype=torch.bfloat16) if has_bias else None
        for index, config in enumerate(SKINNY_SWEEP):
            projection = engine_projection(name, in_features, 1, "cpu", torch.bfloat16, config)
            for kernel, args, kwargs in launches_of(lambda: projection(x, weight, bias)):
                rows.append(
                    {"sweep": "skinny", "regime": f"1.5b_{name}", "config": index}
                    | compile_and_count(kernel, args, kwargs, arch)
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="the compute capability compiled for (90: Hopper)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if triton is None or tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 5):
        parser.error("needs triton >= 3.5 (ASTSource by argument name and a bundled ptxas)")
    rows = measure(args.arch)
    result = {
        "arch": f"sm_{args.arch}",
        "triton": triton.__version__,
        "torch": torch.__version__,
        "paged_configs": [asdict(config) for config in PAGED_SWEEP],
        "skinny_configs": [asdict(config) for config in SKINNY_SWEEP],
        "launches": rows,
    }
    version = ".".join(triton.__version__.split(".")[:2])
    write_result(args.out, f"kernel_resources_sm{args.arch}_triton{version}", result)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    print(
        "| sweep | regime | config | kernel | warps | stages | registers | spill B | shared B | cp.async | 16-B loads |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['sweep']} | {row['regime']} | {row['config']} | {row['kernel']} | {row['num_warps']} | "
            f"{row['num_stages']} | {row['registers']} | {row['spill_store_bytes']} | {row['shared_bytes']} | "
            f"{row['async_copies']} | {row['global_loads_16_byte']} / {row['global_loads']} |"
        )


if __name__ == "__main__":
    main()
