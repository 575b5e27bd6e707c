"""Waiting on several calls issued together, so roles on different devices run at the same time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from spmd_rlhf.runtime.errors import CallTimeout
from spmd_rlhf.runtime.handles import CallFuture


def wait_together(
    calls: dict[str, CallFuture], *, timeout_s: float, on_done: Callable[[str, float], None] | None = None
) -> list[Any]:
    """The results of calls already issued, in the order of ``calls``. ``on_done(name, seconds)`` is told when the
    controller saw each call complete, counted from now (calls on different devices overlap, so these may sum to more
    than the wall time). Waits at most ``timeout_s`` in all, then raises ``CallTimeout`` naming a call still running;
    a failed worker raises at once."""
    started = time.perf_counter()
    deadline = started + timeout_s
    pending = dict(calls)
    while pending:
        for name in [name for name, call in pending.items() if call.done()]:
            if on_done is not None:
                on_done(name, time.perf_counter() - started)
            del pending[name]
        if pending:
            waited = next(iter(pending.values()))
            try:  # wakes when any rank reports, and raises at once if a worker failed
                waited.result(timeout=max(0.0, min(0.01, deadline - time.perf_counter())))
            except CallTimeout:
                if time.perf_counter() >= deadline:
                    raise
    return [call.result() for call in calls.values()]
