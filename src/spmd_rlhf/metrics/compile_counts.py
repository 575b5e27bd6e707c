"""What TorchDynamo compiled in this process step by step: the graphs it made and the seconds it spent on them. A
run that compiles in every step pays seconds for what should be a replay (an H200's GRPO step went from 2.1 to 25 s
in session 48 with compile-like stage times in every step); the metrics show it, and a step that compiles after the
first few says so in the log. Read from TorchDynamo's own counters (``torch._dynamo.utils``: private, so read
defensively, zero where absent); the controller's process only, which hosts rank 0's roles."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SETTLING_STEPS = 2
"""Steps allowed to compile without a word: the first compiles every block, the second what differs in it (a
validation pass, the first step of a kept engine's later shapes)."""


def _totals() -> tuple[int, float]:
    """Graphs TorchDynamo has compiled in this process, and the seconds its compiles took."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:  # pragma: no cover - a build without TorchDynamo
        return 0, 0.0
    return int(counters["stats"].get("unique_graphs", 0)), float(
        sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    )


class CompileCounts:
    """``step_metrics()`` once per step: ``compile/graphs`` and ``compile/seconds`` since the previous call (or
    construction)."""

    def __init__(self) -> None:
        self._graphs, self._seconds = _totals()
        self._steps = 0

    def step_metrics(self) -> dict[str, float]:
        graphs, seconds = _totals()
        metrics = {"compile/graphs": float(graphs - self._graphs), "compile/seconds": seconds - self._seconds}
        self._graphs, self._seconds = graphs, seconds
        self._steps += 1
        if self._steps > SETTLING_STEPS and metrics["compile/graphs"] > 0:
            logger.warning(
                "TorchDynamo compiled %d graphs (%.1f s) in step %d, after the first %d steps: a guard keeps failing "
                "and each compile costs seconds; TORCH_LOGS=recompiles names the guard",
                metrics["compile/graphs"],
                metrics["compile/seconds"],
                self._steps - 1,
                SETTLING_STEPS,
            )
        return metrics
