"""Where a step's time goes: ``profiled`` runs a block under ``torch.profiler`` and writes its ops' self times as a
table (``trainer.profile_steps`` in a recipe; ``--profile`` in the GPU benchmarks), and on a GPU the device syncs by the
line that made them (``DeviceSyncs``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from spmd_rlhf.metrics.device_syncs import DeviceSyncs


@contextmanager
def profiled(
    path: str | os.PathLike | None, *, rows: int = 25, trace: str | os.PathLike | None = None
) -> Iterator[None]:
    """Run the block under ``torch.profiler`` (CPU, and CUDA where there is a GPU) when ``path`` is given and write
    there the ops' self host times, their inclusive host times and their self device times, ``rows`` of each; with
    ``trace``, also the timeline there (Chrome's trace format, gzipped when the name ends in ``.gz``: Perfetto opens
    it). Host ops are those of every thread of the process, device kernels every kernel it launched. With ``path``
    None, the block runs as it is."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    # The roles' work runs in the runtime's worker threads, which the profiler sees only when told to.
    try:
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option: the calling thread's host ops, every kernel
        every_thread = None
    with DeviceSyncs() as syncs, profile(activities=activities, experimental_config=every_thread) as profiler:
        yield
    averages = profiler.key_averages()
    tables = [
        f"== by self host time\n{averages.table(sort_by='self_cpu_time_total', row_limit=rows)}",
        # Inclusive times name the regions (an optimizer step, a compiled region, a compile) the ops ran in.
        f"== by total host time\n{averages.table(sort_by='cpu_time_total', row_limit=rows)}",
    ]
    if torch.cuda.is_available():
        tables.append(f"== by self device time\n{averages.table(sort_by='self_cuda_time_total', row_limit=rows)}")
        tables.append(f"== where the host waited for the device, by line\n{syncs.table(rows)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Path(path).write_text("\n".join(tables))
    print(f"wrote profile {path}", flush=True)
    if trace is not None:
        profiler.export_chrome_trace(str(trace))
        print(f"wrote trace {trace}", flush=True)
