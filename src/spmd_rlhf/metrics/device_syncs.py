"""Where the host waited for the GPU over a stretch of code, by the line that made it wait.

    with DeviceSyncs() as syncs:
        recipe.step(step)
    syncs.total, syncs.sites      # Counter: "training/packing.py:150" -> 8

On a CUDA device PyTorch can warn at every synchronizing operation (``torch.cuda.set_sync_debug_mode("warn")``:
``.item()``, ``.tolist()`` and ``.cpu()`` of a device tensor, a pageable copy to the host, ``nonzero``, a boolean
mask's indexing, ``torch.cuda.synchronize``); each warning is counted here under the innermost line of this package
that the waiting thread was running (the roles run in the runtime's worker threads: every thread is seen), and not
shown. On CPU nothing waits, so nothing is counted: ``DispatchCounts`` counts scalar reads there, but not
``.tolist()`` or ``.cpu()``, which dispatch nothing on a host tensor; this is their count on a GPU.

Not seen, as PyTorch documents: the ``torch.distributed`` collectives' waits, and syncs in threads PyTorch's
warnings do not reach Python from (the autograd engine's device threads, where a backward op would sync). The debug
mode is process-wide while the block runs, and the warnings' filters and ``warnings.showwarning`` are restored after.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter

import torch

from spmd_rlhf.metrics.dispatch_counts import innermost_package_line

SYNC_WARNING = "called a synchronizing CUDA operation"
"""The start of the warning PyTorch's sync debug mode gives (``c10/cuda/CUDAFunctions.cpp``, torch 2.11 to 2.13)."""
TOTAL_LINE = "{} device syncs"
"""The first line of ``DeviceSyncs.table``: the total (``total_in_table`` reads it back)."""


class DeviceSyncs:
    """Counts the device syncs PyTorch reports while active, by the innermost package line that made each;
    ``armed``: whether to turn PyTorch's sync debug mode on (default: where CUDA is available)."""

    def __init__(self, *, armed: bool | None = None) -> None:
        self.armed = torch.cuda.is_available() if armed is None else armed
        self.sites: Counter[str] = Counter()
        self._previous_mode = 0

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> DeviceSyncs:
        self._warnings = warnings.catch_warnings()  # restores the filters and showwarning on exit
        self._warnings.__enter__()
        # Python shows a warning once per line by default: every sync is to be counted.
        warnings.filterwarnings("always", message=SYNC_WARNING)
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        self._shown_elsewhere = warnings.showwarning
        warnings.showwarning = self._count
        if self.armed:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc_info) -> None:
        if self.armed:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._warnings.__exit__(*exc_info)

    def _count(self, message, category, filename, lineno, file=None, line=None) -> None:
        if str(message).startswith(SYNC_WARNING):
            self.sites[innermost_package_line(counter=__file__)] += 1
        else:
            self._shown_elsewhere(message, category, filename, lineno, file, line)

    def table(self, rows: int = 25) -> str:
        """The total, then the ``rows`` lines that waited most, one per line."""
        lines = [TOTAL_LINE.format(self.total)]
        lines += [f"{count:8d}  {site}" for site, count in self.sites.most_common(rows)]
        return "\n".join(lines)


def total_in_table(text: str) -> int | None:
    """The total of a ``DeviceSyncs.table`` found in ``text`` (a profile's tables), or None where there is none (a
    profile written off a GPU)."""
    found = re.search("^" + TOTAL_LINE.format(r"(\d+)") + "$", text, flags=re.MULTILINE)
    return int(found.group(1)) if found else None
