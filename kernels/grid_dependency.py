"""Programmatic dependent launch (Hopper and later): a kernel launched with ``launch_pdl`` may start while the kernel
before it on the stream finishes, its programs waiting at ``griddepcontrol.wait`` until that kernel has completed and
its memory is visible. A decode step inside a CUDA graph is a chain of small kernels each a few microseconds long,
and each boundary costs the next one's launch; with this the next kernel's programs are resident and waiting when
the previous one ends. Imported only where triton is installed."""

from __future__ import annotations

from spmd_rlhf.kernels.triton_support import tl, triton


@triton.jit
def wait_for_the_kernel_before(DEPENDENT_LAUNCH: tl.constexpr):
    """The first thing a dependent-launch kernel does: wait for the kernel before it (its stores, and its reads of
    what this one writes, all done), then let the kernel after it launch. Nothing before it touches memory, so the
    kernel reads and writes exactly as it would in plain stream order; the kernel after it waits likewise."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
