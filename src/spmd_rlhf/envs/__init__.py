"""Multi-turn environments and tools: the environment interface (``base``), tools with JSON schemas and the
Hermes / Qwen ``<tool_call>`` format (``tools``), sandboxed built-in tools (``sandbox``), the tool environment
(``tool_env``), token-exact observation deltas (``chat_delta``) and the rollout loop on the engine (``rollout``).

``rollout.environment`` names the environment of a run: ``tool`` (``ToolEnvironment`` with the built-in calculator
and Python tools) or ``path/to/file.py:name``, a class or function in a user file that makes a fresh
``Environment`` when called with no arguments.
"""

from __future__ import annotations

from spmd_rlhf.envs.base import Environment, EnvironmentFactory, StepResult, initial_messages
from spmd_rlhf.envs.chat_delta import ChatDelta, TemplateDeltaError, TrajectoryDriftError, check_prefix_extension
from spmd_rlhf.envs.tool_env import ToolEnvironment
from spmd_rlhf.envs.tools import Tool, ToolCall, call_tool, format_tool_call, parse_tool_calls

ENVIRONMENTS: dict[str, EnvironmentFactory] = {"tool": ToolEnvironment}
"""Built-in environments by name."""


def environment_factory(spec: str) -> EnvironmentFactory:
    """The factory ``rollout.environment`` names: a built-in name or ``path/to/file.py:name``."""
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    if ".py:" not in spec:
        raise ValueError(
            f"rollout.environment={spec!r} is not a built-in environment ({', '.join(ENVIRONMENTS)}) nor "
            f"path/to/file.py:name"
        )
    from spmd_rlhf.rewards.registry import load_function

    return load_function(spec, name="rollout.environment")


__all__ = [
    "ChatDelta",
    "ENVIRONMENTS",
    "Environment",
    "EnvironmentFactory",
    "StepResult",
    "TemplateDeltaError",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "TrajectoryDriftError",
    "call_tool",
    "check_prefix_extension",
    "environment_factory",
    "format_tool_call",
    "initial_messages",
    "parse_tool_calls",
]
