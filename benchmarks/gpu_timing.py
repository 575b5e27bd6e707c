"""Timing helpers of the kernel benchmarks (``gpu_kernels.py``, ``gpu_skinny_sweep.py``): the best of a few calls,
and one call's device time inside a CUDA graph, as a decode step's layers run it."""

from __future__ import annotations

import time

import torch
from gpu_common import synchronize


def best_seconds(function, device: str, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls after one warm-up call (which compiles a Triton kernel)."""
    function()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


GRAPH_CALLS = 28
"""Calls captured into one CUDA graph to time a batch-1 call: a decode step's layers (28 in the 1.5B and 7B shapes)."""


def graphed_seconds(function, device: str, repeats: int) -> float:
    """Device time of one call with the host out of the way, as inside a decode step's CUDA graph: ``GRAPH_CALLS``
    calls captured into one graph, the fastest of ``repeats`` replays divided by ``GRAPH_CALLS`` (a batch-1 call is a
    few microseconds, below one eager call's host time). Off CUDA: ``best_seconds``."""
    if torch.device(device).type != "cuda":
        return best_seconds(function, device, repeats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (the Triton compile) off the capture, as torch.cuda.graph advises
        function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            function()
    return best_seconds(graph.replay, device, repeats) / GRAPH_CALLS
