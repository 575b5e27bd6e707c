"""Transparent huge pages for a CPU rank's heap, by restarting the rank once with glibc's ``glibc.malloc.hugetlb=1``.

On CPU every large transient tensor (FSDP's gathered units and unsharded gradients, a micro-batch's logits and
activations) is a fresh ``mmap`` from glibc (above 32 MiB always, whatever ``MALLOC_MMAP_THRESHOLD_`` says), which
the kernel faults in and zeroes 4 KiB at a time and glibc unmaps again when the tensor is freed, so a 0.5B-shaped
step spends as much time in the kernel as in its matmuls. Where the kernel's THP mode is ``madvise`` (the common
default), the tunable makes glibc advise 2 MiB pages for what it maps: 512 times fewer faults. glibc reads tunables
only when a process starts, so a rank started without it replaces itself (``os.execve``: same pid, so torchrun's
agent and SLURM keep tracking it) before it has built or joined anything. ``trainer.host_huge_pages=false`` turns
this off; GPU ranks never restart (their large tensors live in CUDA's caching allocator).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence

THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
TUNABLE = "glibc.malloc.hugetlb"
RESTART_MARK = "SPMD_RLHF_HUGE_PAGE_RESTART"
"""Set in the restarted process, so that a glibc that ignores the tunable can never restart a rank twice."""


def thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``: the bracketed word), or None
    where there is no such file (not Linux, or a kernel without THP)."""
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_page_restart(
    *,
    environ: Mapping[str, str],
    argv: Sequence[str],
    orig_argv: Sequence[str],
    mode: str | None,
    libc: str,
) -> tuple[list[str], dict[str, str]] | None:
    """The command line and environment that restart this process with huge pages for its heap, or None when a
    restart would gain nothing or could not reproduce the process: THP not in ``madvise`` mode (``always`` needs no
    advice, ``never`` takes none), not glibc, the tunable already set, already restarted once, or the process not
    started as ``python [options] script.py ...`` (the way torchrun starts a rank) but, say, inside pytest, where
    ``argv[0]`` is not the script on its command line."""
    if mode != "madvise" or libc != "glibc" or environ.get(RESTART_MARK):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:
        return None
    if not argv or not argv[0].endswith(".py") or argv[0] not in orig_argv[1:]:
        return None
    setting = f"{TUNABLE}=1"
    return list(orig_argv), {
        **environ,
        "GLIBC_TUNABLES": f"{tunables}:{setting}" if tunables else setting,
        RESTART_MARK: "1",
    }


def restart_with_huge_pages() -> None:
    """Replace this process by itself with huge pages for its heap, when ``huge_page_restart`` says so; call it
    before anything else starts (threads, sockets, the process group). Returns only when there is nothing to do."""
    restart = huge_page_restart(
        environ=os.environ,
        argv=sys.argv,
        orig_argv=sys.orig_argv,
        mode=thp_mode(),
        libc=platform.libc_ver()[0],
    )
    if restart is None:
        return
    command, environment = restart
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, environment)
