"""The tool environment: the policy calls tools in its chat template's format, the environment runs them and answers
with ``tool`` messages (each with a ``tool_call_id``: ``tools.tool_call_id``); a turn without a tool call is the
final answer and ends the trajectory.

The tools of a row are those its ``extra_info["tools"]`` lists (OpenAI schemas, or bare names), looked up by name
among the environment's tools; the dataset also passes those schemas to the chat template, which puts them in the
system prompt as the model's family expects. A row without a list gets every tool of the environment.
"""

from __future__ import annotations

from typing import Any

from spmd_rlhf.envs.base import Environment, StepResult, initial_messages
from spmd_rlhf.envs.sandbox import sandboxed_tool
from spmd_rlhf.envs.tools import Tool, call_tool, parse_tool_calls, tool_call_id


def builtin_tools() -> dict[str, Tool]:
    """The sandboxed calculator and Python tools under their names."""
    return {name: sandboxed_tool(name) for name in ("calculator", "python")}


def row_tool_names(row: dict[str, Any]) -> list[str] | None:
    """The tool names of ``row["extra_info"]["tools"]`` (schemas or names), or None when the row lists none."""
    listed = (row.get("extra_info") or {}).get("tools")
    if listed is None:
        return None
    names = []
    for entry in listed:
        if isinstance(entry, str):
            names.append(entry)
        elif isinstance(entry, dict) and isinstance(entry.get("function", entry).get("name"), str):
            names.append(entry.get("function", entry)["name"])
        else:
            raise ValueError(f"extra_info.tools entries are tool names or OpenAI tool schemas, got {entry!r:.80}")
    return names


class ToolEnvironment(Environment):
    observation_roles = ("tool",)

    def __init__(self, tools: dict[str, Tool] | None = None) -> None:
        self.all_tools = builtin_tools() if tools is None else tools
        self.tools: dict[str, Tool] = {}
        self.calls = self.errors = 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        names = row_tool_names(row)
        if names is None:
            self.tools = dict(self.all_tools)
        else:
            unknown = sorted(set(names) - set(self.all_tools))
            if unknown:
                raise ValueError(
                    f"extra_info.tools names {unknown}, which this environment does not have; it has "
                    f"{sorted(self.all_tools)}"
                )
            self.tools = {name: self.all_tools[name] for name in names}
        self.calls = self.errors = 0
        return initial_messages(row)

    def step(self, messages: list[dict[str, Any]], new_text: str) -> StepResult:
        calls = parse_tool_calls(new_text)
        if not calls:
            return StepResult(done=True)
        observations = []
        for call in calls:
            text, failed = call_tool(self.tools, call)
            observations.append({"role": "tool", "content": text, "tool_call_id": tool_call_id(self.calls)})
            self.calls += 1
            self.errors += failed
        return StepResult(observations)

    def metrics(self) -> dict[str, float]:
        return {"tool_calls": float(self.calls), "tool_errors": float(self.errors)}
