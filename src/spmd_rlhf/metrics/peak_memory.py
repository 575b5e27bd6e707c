"""Peak memory of one rank over a stretch of code: the CUDA allocator's statistics on GPU; on CPU, every tensor
storage created through the dispatcher while tracking, counted from its creation until it is freed.

    with PeakMemory(device) as memory:
        model = hybrid.generation_model(dtype)
        ...
    memory.peak_increase  # bytes above what was live on entry

The CPU count sees what PyTorch allocates for op outputs (factories, collectives' output buffers, FSDP's gathered
parameters, DTensor locals), sampled after every op, not a backend's private scratch buffers or an op's internal
temporaries. And ``saved_activation_bytes``: what autograd keeps for the backward of one forward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageCounter(TorchDispatchMode):
    """Live bytes of the storages created while active, re-summed after every op: FSDP frees and re-allocates its
    gathered parameters by resizing their storages in place, which no op or finaliser reports."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage, lambda _, key=key: self._storages.pop(key, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        live = 0
        for reference in list(self._storages.values()):
            storage = reference()
            if storage is not None:
                live += storage.nbytes()
        self.peak = max(self.peak, live)
        return out


class PeakMemory:
    """Context manager measuring the peak of allocated bytes above the level at entry, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.peak_increase = 0
        self._counter: _StorageCounter | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._counter = _StorageCounter()
            self._counter.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_increase = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            self._counter.__exit__(*exc_info)
            self.peak_increase = self._counter.peak


GIB = 2**30


def step_memory_metrics() -> dict[str, float]:
    """This process's CUDA memory since the previous call (one step): ``memory/peak_allocated_gib`` (the
    allocator's high-water mark of live tensors), ``memory/peak_reserved_gib`` (of what the caching allocator held),
    ``memory/reserved_gib`` (held now), ``memory/alloc_retries`` (allocations that failed, freed the cache and tried
    again: each frees device memory, which waits for the device) and ``memory/device_mallocs`` (cudaMalloc calls: a
    step that keeps making them is not reusing its cache); then resets the high-water marks and the counts. Reading
    them is host bookkeeping, no device sync. Empty where CUDA was never initialised (CPU runs, also on a GPU machine
    with ``trainer.device=cpu``). The caller's thread must be bound to its rank's device
    (``runtime.device.bind_thread``)."""
    if not torch.cuda.is_initialized():
        return {}
    device = torch.cuda.current_device()
    counts = torch.cuda.memory_stats(device)
    metrics = {
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        "memory/reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "memory/alloc_retries": float(counts.get("num_alloc_retries", 0)),
        "memory/device_mallocs": float(counts.get("num_device_alloc", 0)),
    }
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.reset_accumulated_memory_stats(device)
    return metrics


def saved_activation_bytes(model: torch.nn.Module, forward: Callable[[], object]) -> int:
    """Bytes autograd keeps for the backward of ``forward()`` (a forward pass of ``model``), tensors that share a
    parameter's storage left out: the activations a device holds between the forward and the backward. Counts each
    time a tensor is saved, so a tensor saved by two ops counts twice (an upper bound)."""
    parameters = set()
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        parameters.add(local.untyped_storage().data_ptr())
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        try:
            owned = tensor.untyped_storage().data_ptr() not in parameters
        except RuntimeError:  # a wrapper subclass without storage of its own: an activation
            owned = True
        if owned:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return total
