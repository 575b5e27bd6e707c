"""Activations kept for the backward in host memory (``model.activation_offload``): each tensor autograd saves in a
training forward, when it is on the device, is a tensor of its own (not a parameter or a view of one: FSDP gathers
those again for the backward) and is at least ``min_bytes``, is copied into pinned host memory as it is saved and back
to the device when the backward needs it (``torch.autograd.graph.saved_tensors_hooks``). Device memory then holds a
micro-batch's activations only while they are made and used, for two PCIe copies of each.

Both copies run on the current stream, so they are ordered with the kernels around them without a wait on the host:
the copy out reads the tensor before any later kernel can reuse its memory, and the copy back lands before the kernel
that reads it. They do not overlap with compute (a side stream would, at the cost of events per tensor).

A tensor comes back with the strides it was saved with: compiled blocks (Inductor) check the size and stride of every
saved tensor they read in the backward, and a permuted activation made contiguous fails that check. A view that does
not cover its memory densely (a slice with gaps) stays on the device: copying it whole would move what it does not
use, and only the whole could keep its strides.
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_MIN_BYTES = 1 << 20
"""Tensors smaller than this stay where they are: a copy's fixed cost is worth it only for large activations."""


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Inside it, saved tensors on a ``source`` device (``cuda``; tests give ``cpu``) go to host memory (pinned when
    the source is a GPU). Counts what it moved: ``offloaded`` tensors, ``offloaded_bytes``."""

    def __init__(self, *, source: str = "cuda", min_bytes: int = DEFAULT_MIN_BYTES) -> None:
        self.offloaded = self.offloaded_bytes = 0
        pinned = source == "cuda"

        def pack(tensor: torch.Tensor):
            size = tensor.numel() * tensor.element_size()
            if tensor.device.type != source or size < min_bytes or _is_parameter(tensor) or not _dense(tensor):
                return tensor
            host = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, pin_memory=pinned)
            host.copy_(tensor, non_blocking=pinned)
            self.offloaded += 1
            self.offloaded_bytes += size
            return tensor.device, host

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            back = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
            return back.copy_(host, non_blocking=pinned)

        super().__init__(pack, unpack)

    def __enter__(self) -> ActivationOffload:
        super().__enter__()
        return self


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (a linear layer saves its weight transposed)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory of its size with none overlapping, in any order of dimensions (a
    permutation of a contiguous tensor is dense; a slice with gaps or an expanded tensor is not)."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True
