"""Sampled tokens read back one step late: the overlapped decode loop's device-to-host copies (``llm_engine``).

A decode step's samples (``sampler.draw``: ids and their two log-probs, ``[3, rows]`` float32) are copied
without waiting into a pinned host buffer, and an event is recorded after the copy. The host goes on to plan and
launch the next step, and only then waits on the event: by then the device has long finished the copy, or is busy
with the step just launched, so the wait never leaves it idle. Two buffers take turns, because the copy of step t + 1
is queued before the host reads that of step t. Off CUDA the copy is done when it returns and there is no event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spmd_rlhf.engine.sampler import read_samples


@dataclass
class PendingSamples:
    """One step's samples on their way to the host: ``read`` waits for them."""

    buffer: np.ndarray
    """``[3, rows]`` view of the host buffer the copy lands in."""
    copied: torch.cuda.Event | None

    def read(self) -> tuple[list[int], list[float], list[float]]:
        """``sample``'s three lists, once the copy has landed (the step's wait, one step late)."""
        if self.copied is not None:
            self.copied.synchronize()
        return read_samples(self.buffer.tolist())


class SampleReadback:
    """Two host buffers (pinned on CUDA) that decode steps' samples are copied into, in turn."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._views: list[tuple[tuple[int, int], torch.Tensor, np.ndarray] | None] = [None, None]
        """Each buffer's latest ``[3, columns]`` view as a tensor and its ``[3, rows]`` columns as numpy, by
        (columns, rows): kept while the batch keeps its size."""
        self._events = [torch.cuda.Event() if self._pinned else None for _ in range(2)]
        self._turn = 0

    def start(self, samples: torch.Tensor, rows: int) -> PendingSamples:
        """Queue the copy of ``samples`` (``[3, columns]`` float32 on the device, contiguous: a static decode step's
        whole output) to the host, of which the first ``rows`` columns are read; the buffer it lands in is not reused
        before the copy after the next one, so read each one before starting two more."""
        turn, columns = self._turn, samples.shape[1]
        self._turn = 1 - turn
        view = self._views[turn]
        if view is None or view[0] != (columns, rows):
            buffer = self._buffers[turn]
            if buffer is None or buffer.numel() < 3 * columns:
                buffer = self._buffers[turn] = torch.empty(3 * columns, dtype=torch.float32, pin_memory=self._pinned)
            host = buffer[: 3 * columns].view(3, columns)
            view = self._views[turn] = ((columns, rows), host, host.numpy()[:, :rows])
        view[1].copy_(samples, non_blocking=self._pinned)
        event = self._events[turn]
        if event is not None:
            event.record()
        return PendingSamples(view[2], event)
