"""Which device a rank works on, and the one way a thread binds itself to it.

CUDA's current device is per thread: ``torch.cuda.set_device`` on the main thread leaves every other thread on
cuda:0. Whatever takes its device from the current one (FSDP2's ``fully_shard``, NCCL's communicators and batched
point-to-point calls, allocations and kernels without an explicit device) then works on the wrong GPU, and NCCL
sees two ranks on one device and hangs. So every thread that touches the device calls ``bind_thread`` before
anything else (the launch's main thread, the executor thread that runs all role code), and role code calls
``check_thread`` so that a thread that was never bound fails at once, naming itself, instead of hanging later.

Thread inventory (keep it current): the main thread (``launch``), the executor thread (``Executor._loop``) and the
calibration's link processes (``mapping.calibrate``) bind; the heartbeat, abort timers and RPC handler threads only
pass small Python messages; reward rules run in worker processes (``rewards.runner``) on strings. Autograd's backward
threads set their own device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from spmd_rlhf.config import DEVICE_SETTINGS


def select_device(setting: str, *, local_rank: int, cuda_devices: int) -> tuple[torch.device, str]:
    """(this rank's device, the process-group backend) for ``trainer.device=setting`` on a machine where
    ``cuda_devices`` CUDA devices are visible (0: no usable CUDA).

    cpu: gloo only, even on a GPU machine; cuda: this process's GPU (``cuda:<local_rank>``), NCCL for device tensors
    and gloo for the small host-side reductions (metrics, row counts); auto: cuda when there is a GPU, else cpu."""
    if setting not in DEVICE_SETTINGS:
        raise ValueError(f"trainer.device={setting}: must be one of {', '.join(DEVICE_SETTINGS)}")
    if setting == "cpu" or (setting == "auto" and cuda_devices == 0):
        return torch.device("cpu"), "gloo"
    if cuda_devices == 0:
        raise ValueError(
            "trainer.device=cuda but this machine has no usable CUDA device (torch.cuda.is_available() is false; "
            "check the driver, CUDA_VISIBLE_DEVICES and that torch is a CUDA build); set trainer.device=cpu or auto"
        )
    if local_rank >= cuda_devices:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {cuda_devices} CUDA devices are visible to this process; start at most "
            f"one process per GPU (torchrun --nproc-per-node {cuda_devices}) and leave CUDA_VISIBLE_DEVICES unset "
            f"or listing every GPU of the node"
        )
    return torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl"


def visible_cuda_devices() -> int:
    """CUDA devices this process can use (0 without a usable CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bind_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing to do for a CPU device). Call it first in
    every thread that touches the device."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def steady_attention_kernels(device: torch.device) -> None:
    """On CUDA, SDPA no longer picks cuDNN's attention, which builds an execution plan for every new shape
    (milliseconds of host time each: session 49's H200 profile of one GRPO step shows 7 ms per forward call, 9 per
    backward), where an RL step's packed rows and prefills change shape every micro-batch; the flash and
    memory-efficient kernels serve the same calls with none. Process-wide, so the launch sets it once."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def thread_device_mismatch(device: torch.device, current_index: int, thread_name: str) -> str | None:
    """The error message when a thread whose current CUDA device is ``current_index`` works for ``device``; None
    when they agree (always for a CPU device)."""
    if device.type != "cuda" or current_index == device.index:
        return None
    return (
        f"thread {thread_name!r} is on cuda:{current_index} but this rank works on {device}: every thread that "
        f"touches the device must call spmd_rlhf.runtime.device.bind_thread({str(device)!r}) first (CUDA's "
        f"current device is per thread)"
    )


def check_thread(device: torch.device, *, current_index: Callable[[], int] | None = None) -> None:
    """Raise ``RuntimeError`` naming the calling thread unless its current CUDA device is ``device``.
    ``current_index``: the current-device query (``torch.cuda.current_device``; replaceable for tests)."""
    if device.type != "cuda":
        return
    query = current_index or torch.cuda.current_device
    problem = thread_device_mismatch(device, query(), threading.current_thread().name)
    if problem is not None:
        raise RuntimeError(problem)
