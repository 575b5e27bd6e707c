"""What TorchDynamo did while compiling, for the tests and programs that hold compiled blocks to it."""

from torch._dynamo.utils import compilation_time_metrics


def restarted_analyses() -> list[str]:
    """The compile attempts TorchDynamo made beyond each frame's first since ``compilation_time_metrics`` was last
    cleared: each a whole trace again (a float input that an operator must specialise restarts the analysis, as does
    a graph break)."""
    return [
        key for key in compilation_time_metrics if key.startswith("compile_attempt_") and key != "compile_attempt_0"
    ]
