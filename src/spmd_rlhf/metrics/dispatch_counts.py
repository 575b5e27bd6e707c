"""Exact counts of what the host sends through the PyTorch dispatcher over a stretch of code: every call, the calls
that are not views (each about one kernel launch on a GPU), the scalar reads (``aten._local_scalar_dense``:
``.item()``, ``float()``, ``int()``, ``bool()`` of a tensor, each a wait for the device on a GPU) and the copies FSDP
issues to gather and release its units.

    with DispatchCounts() as counts:
        actor.update_actor(batch)
    counts.non_view_calls, counts.scalar_reads, counts.fsdp_copies

Counted on CPU, these are what a GPU run would launch and wait for, so a regression in host overhead shows before anyone
has a GPU (``benchmarks/host_overhead.py``). Ops a tensor subclass (DTensor) runs for its own ops are not seen: the
mode counts what the caller asked for.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FSDP_SOURCE = os.path.join("torch", "distributed", "fsdp", "")
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


def _is_copy(name: str) -> bool:
    """Ops that copy tensors whole: ``copy_``, ``_foreach_copy_``, ``split_with_sizes_copy``, FSDP's
    ``all_gather_copy_in`` and ``chunk_cat`` (its reduce-scatter input)."""
    return "copy" in name or name.endswith("chunk_cat")


class DispatchCounts(TorchDispatchMode):
    """Calls by op name while active; ``scalar_read_sites`` names the line of the package's code that made each
    scalar read (its innermost ``spmd_rlhf`` frame)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.non_view_calls = 0
        self.fsdp_copies: Counter[str] = Counter()
        self.scalar_read_sites: Counter[str] = Counter()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def scalar_reads(self) -> int:
        return sum(self.scalar_read_sites.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] += 1
        if not func.is_view:
            self.non_view_calls += 1
        if func is _SCALAR_READ:
            self.scalar_read_sites[innermost_package_line()] += 1
        elif _is_copy(name) and _called_from_fsdp():
            self.fsdp_copies[name] += 1
        return func(*args, **(kwargs or {}))


def _frames():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _called_from_fsdp() -> bool:
    return any(_FSDP_SOURCE in frame.f_code.co_filename for frame in _frames())


def innermost_package_line(*, counter: str = __file__) -> str:
    """``path:line`` of the innermost frame of this package's code that called into the ``counter`` module (whose
    own frames are left out), or ``"outside spmd_rlhf"``."""
    for frame in _frames():
        path = frame.f_code.co_filename
        if f"spmd_rlhf{os.sep}" in path and path != counter:
            return f"{path[path.rindex(f'spmd_rlhf{os.sep}') :]}:{frame.f_lineno}"
    return "outside spmd_rlhf"
