"""The optional Triton import and the one rule every kernel wrapper uses to pick Triton or its torch reference.

Triton is an optional dependency (extra ``kernels``): without it every wrapper runs its pure-torch reference. The
kernels also run on CPU tensors under Triton's interpreter, which is how the CPU test suite checks them; the
interpreter replaces ``@triton.jit`` functions when they are defined, so ``TRITON_INTERPRET=1`` must be in the
environment before a kernel module is first imported (the tests run those checks in a subprocess).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

KERNEL_BACKENDS = ("auto", "triton", "torch")

INTERPRETING = triton is not None and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
"""True when the kernels were defined under Triton's CPU interpreter: Triton reads the variable when ``@triton.jit``
runs, so it is read once here, at import, too."""


def triton_available() -> bool:
    """True when the optional ``triton`` package is importable."""
    return triton is not None


def launch_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors' device for the launch (a process driving
    several GPUs need not have switched to it); CPU tensors under the interpreter need nothing."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def use_triton(device: torch.device, backend: str) -> bool:
    """Whether a kernel wrapper runs its Triton kernel (True) or its torch reference (False) for tensors on ``device``.

    ``auto`` takes Triton for CUDA tensors when it is installed (the interpreter is far too slow to be picked
    silently); ``triton`` insists, and on CPU tensors that needs the interpreter; ``torch`` is the reference.
    """
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend {backend!r} is unknown; choose one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "torch":
        return False
    if backend == "auto":
        return triton is not None and device.type == "cuda"
    if triton is None:
        raise ValueError("kernel backend 'triton' needs the triton package (pip install triton)")
    if device.type != "cuda" and not INTERPRETING:
        raise ValueError(
            f"kernel backend 'triton' got {device.type} tensors; Triton kernels run on CUDA, or on CPU only with "
            "TRITON_INTERPRET=1 set before the kernel module is imported"
        )
    return True


def dependent_launch_option(dependent_launch: bool) -> dict[str, bool]:
    """The launch option of a kernel whose tiling asks for programmatic dependent launch (``kernels.grid_dependency``):
    Triton's ``launch_pdl``, none otherwise. Refused under the interpreter, which has no grids to chain."""
    if not dependent_launch:
        return {}
    if INTERPRETING:
        raise ValueError("dependent_launch needs CUDA (Hopper or later); turn it off under TRITON_INTERPRET")
    return {"launch_pdl": True}


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (CUDA), or 8 under the CPU interpreter; asked once per device (kernels that
    size their launch by it run in every layer of every eager decode step)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counts(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counts, at least ``count`` of them, for kernels whose programs count their arrivals and whose last
    program finishes the work (split-K's combine in the paged decode kernel, the split sum in the skinny-linear one)
    and sets its count back to 0: so the buffer is zero between launches (launches on one stream run in order), and
    one buffer per device serves every such launch and every CUDA graph that captured its address. A larger one is
    made when needed (powers of two, from 16,384: once, in the decode graphs' warm-up before capture), the old ones
    kept for the process, since a captured graph may point at them."""
    device = torch.device(device)
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        size = max(16384, 1 << (count - 1).bit_length())
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def counts_left(device: torch.device) -> bool:
    """Whether any of ``device``'s arrival counts is not 0 (a launch left unfinished, or a bug): tests ask it."""
    return any(bool(buffer.any()) for buffer in _ARRIVALS.get(torch.device(device), []))
