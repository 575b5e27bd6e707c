"""The data plane's point-to-point paths: grouping follows the tensors' device, and both paths carry a pairwise
exchange (two ranks sending to each other at once) between two gloo ranks."""

import torch
from torchrun_helpers import torchrun

from spmd_rlhf.runtime.transfer import groups_point_to_point


def test_device_tensors_are_grouped_and_host_tensors_are_not():
    # Chosen by the tensors' device, not by the backend string ("cpu:gloo,cuda:nccl" is never "nccl").
    assert groups_point_to_point(torch.device("cuda", 3))
    assert groups_point_to_point(torch.device("cuda"))
    assert not groups_point_to_point(torch.device("cpu"))


def test_pairwise_exchange_one_by_one_and_grouped():
    finished = torchrun("pairwise_exchange.py", nproc=2, timeout=120, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    for rank in (0, 1):
        for grouped in (False, True):
            assert f"ok rank {rank} grouped={grouped}" in finished.stdout, finished.stdout[-3000:]
