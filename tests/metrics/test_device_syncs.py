"""``DeviceSyncs`` counts the sync warnings PyTorch's sync debug mode gives on a GPU by the innermost package line of
the thread that waited, every one of them, and leaves every other warning, the filters and the mode as they were.
On CPU the warnings are raised by hand from code whose file name is the package's, as PyTorch raises them from the
line that synced."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from spmd_rlhf.metrics.device_syncs import SYNC_WARNING, DeviceSyncs

ROLE_SOURCE = """
import warnings

def read_back(times):
    for _ in range(times):
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:148.)")

def log(message):
    warnings.warn(message)
"""
ROLE_FILE = "/site-packages/spmd_rlhf/workers/fake_role.py"


def _role() -> dict:
    namespace: dict = {}
    exec(compile(ROLE_SOURCE, ROLE_FILE, "exec"), namespace)
    return namespace


def test_every_sync_is_counted_by_the_package_line_and_thread_that_waited():
    role = _role()
    worker = threading.Thread(target=role["read_back"], args=(3,))
    before = warnings.filters[:], warnings.showwarning
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")  # Python shows each line's warning once
        with DeviceSyncs(armed=False) as syncs:
            role["read_back"](2)  # the same line twice
            worker.start()
            worker.join()
            role["log"]("an ordinary warning")
        role["read_back"](1)  # after the block: not counted, shown as usual
    assert syncs.sites == {"spmd_rlhf/workers/fake_role.py:6": 5}, syncs.sites
    assert syncs.total == 5 and syncs.table().splitlines()[0] == "5 device syncs"
    assert [str(warning.message) for warning in shown][0] == "an ordinary warning"
    assert len(shown) == 2 and str(shown[1].message).startswith(SYNC_WARNING)
    assert (warnings.filters, warnings.showwarning) == before


def test_armed_it_turns_the_sync_debug_mode_to_warn_and_back(monkeypatch):
    modes = [2]  # "error", set by someone before the block
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with DeviceSyncs(armed=True):
        assert modes[-1] == "warn"
    assert modes == [2, "warn", 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reads_of_device_tensors_are_counted_and_launches_are_not():
    """The warning PyTorch gives today starts as ``SYNC_WARNING`` says: ``.item()``, ``.tolist()`` and a pageable
    ``.cpu()`` each count once; kernels and a copy to the device from pinned memory do not wait."""
    values = torch.arange(8.0).pin_memory()
    with DeviceSyncs() as syncs:
        on_device = values.to("cuda", non_blocking=True) * 2
        on_device.sum().item()
        on_device.tolist()
        on_device.cpu()
    assert syncs.total == 3, syncs.sites
    assert torch.cuda.get_sync_debug_mode() == 0
