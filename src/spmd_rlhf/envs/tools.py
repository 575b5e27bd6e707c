"""Tools as plain Python callables with OpenAI-style JSON schemas, the Hermes / Qwen tool-call format, and calls that
never raise: a tool that raises, hangs or returns something other than text gives an error observation.

    def lookup(city: str) -> str: ...
    weather = Tool("weather", "Current weather of a city", {"type": "object", "properties": {"city": {"type":
                   "string"}}, "required": ["city"]}, lookup)

A model calls tools the way Qwen2.5 / Qwen3 / Hermes chat templates teach it, one JSON object per block:
``<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>``. ``parse_tool_calls`` reads them;
``format_tool_call`` writes one as those templates render an assistant's call; ``call_tool`` runs one and returns the
text of the ``tool`` message, which carries ``tool_call_id(n)`` for the trajectory's n-th call.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_OUTPUT_CHARS = 4000
"""A tool's text is cut to this many characters: an observation is context the policy pays for in tokens."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """The arguments as a JSON schema object (``{"type": "object", "properties": ..., "required": [...]}``)."""
    function: Callable[..., Any]
    """Called with the arguments as keywords; returns the observation text."""
    timeout_s: float = 10.0
    """A call running longer gives an error observation (an in-process call is abandoned, not stopped: tools that can
    hang or allocate without bound belong in a subprocess, as ``sandbox.SandboxedTool`` runs them)."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema, as ``apply_chat_template(tools=...)`` and verl's tool lists take it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: Any
    error: str | None = None
    """Why the block could not be read as a call (bad JSON, no name); the call then only gives this error back."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text`` in order; a block that is not a JSON object with a
    ``name`` string and an ``arguments`` object (a JSON string holding one is accepted, as some models write it) is a
    call carrying its ``error``."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolCall(None, None, f"the tool call is not valid JSON ({error.msg} at {error.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, None, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], None, f"the arguments of {call['name']} must be a JSON object"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as Qwen2.5 / Hermes chat templates render an assistant's ``tool_calls``: the JSON object on its own
    line between the tags (``parse_tool_calls`` reads it back)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def tool_call_id(index: int) -> str:
    """The ``tool_call_id`` of a trajectory's ``index``-th tool call (from 0): ``call00000``, ``call00001``, ...
    Deterministic, and nine letters and digits, as Mistral's chat templates require of every tool message (they
    refuse to render one without); templates that ignore the id are not affected."""
    if not 0 <= index < 100_000:
        raise ValueError(f"tool call index {index} is outside 0..99999: a trajectory's ids have five digits")
    return f"call{index:05d}"


def _as_text(value: Any) -> str:
    """A tool's return value as observation text: text as it is, numbers and JSON data as JSON; anything else is
    garbage and raises."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float | list | dict) or value is None:
        return json.dumps(value)
    raise TypeError(f"returned a {type(value).__name__}, not text or JSON data")


def _run_in_thread(tool: Tool, arguments: dict[str, Any]) -> str:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["text"] = _as_text(tool.function(**arguments))
        except BaseException as error:  # reported as the observation; the rollout goes on
            outcome["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"did not return within {tool.timeout_s:g} s")
    if "error" in outcome:
        raise RuntimeError(outcome["error"])
    return outcome["text"]


def call_tool(tools: dict[str, Tool], call: ToolCall) -> tuple[str, bool]:
    """(observation text, whether it is an error) of one call. Never raises: a malformed call, an unknown tool, a
    tool that raises, times out or returns garbage all give ``"Error: ..."`` text the policy can read."""
    if call.error is not None:
        return f"Error: {call.error}", True
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or 'none'}", True
    try:
        text = _run_in_thread(tool, call.arguments)
    except Exception as error:
        return f"Error: {call.name} {error}", True
    return text[:MAX_OUTPUT_CHARS], False
