"""The arrival count's two halves, for kernels whose last program to finish completes the work of several (split-K's
combine in ``paged_attention_programs``, the split sum in ``skinny_linear_programs``); the counts live in
``triton_support.arrival_counts``. Imported only where triton is installed."""

from __future__ import annotations

from spmd_rlhf.kernels.triton_support import tl, triton


@triton.jit
def last_to_arrive(arrivals_ptr, index, ARRIVALS: tl.constexpr):
    """Counts this program's arrival at ``index`` and says whether it is the last of ``ARRIVALS``. Every thread's
    stores come before the count (a barrier, then the count's release); the last program's loads after it (the
    acquire) see every other program's stores, read past L1 (``.cg``) as they were written by other
    multiprocessors."""
    tl.debug_barrier()
    return tl.atomic_add(arrivals_ptr + index, 1, sem="acq_rel", scope="gpu") == ARRIVALS - 1


@triton.jit
def reset_arrivals(arrivals_ptr, index):
    """The last program sets the count back to 0 for the next launch (stream order makes it visible there)."""
    tl.atomic_xchg(arrivals_ptr + index, 0, sem="relaxed", scope="gpu")
