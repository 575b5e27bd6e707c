"""Tools never crash a rollout: bad calls, raising, hanging and garbage-returning tools, and the sandboxed built-ins
under their limits, all give error observations; the tool environment answers calls with tool messages."""

from __future__ import annotations

import time

import pytest

from spmd_rlhf.envs import Tool, ToolCall, ToolEnvironment, call_tool, format_tool_call, parse_tool_calls
from spmd_rlhf.envs.sandbox import SandboxError, run_sandboxed, sandboxed_tool
from spmd_rlhf.envs.tools import tool_call_id

NO_ARGS = {"type": "object", "properties": {}}


def test_parse_hermes_tool_calls():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
        '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "x", "arguments": 3}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "12*34"})
    assert calls[1] == ToolCall("python", {"code": "print(1)"})
    assert calls[2].error.startswith("the tool call is not valid JSON")
    assert calls[3].error.startswith("a tool call must be a JSON object")
    assert calls[4].error == "the arguments of x must be a JSON object"
    assert parse_tool_calls("The answer is 408.") == []


def test_format_tool_call_is_read_back():
    text = format_tool_call("calculator", {"expression": "12*34"})
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    assert parse_tool_calls(f"Sure. {text}") == [ToolCall("calculator", {"expression": "12*34"})]


def _tools(**functions) -> dict[str, Tool]:
    return {name: Tool(name, name, NO_ARGS, function, timeout_s=0.5) for name, function in functions.items()}


def test_in_process_tool_failures_become_error_observations():
    def hang():
        time.sleep(30)

    def boom():
        raise ValueError("boom")

    tools = _tools(ok=lambda: 42, boom=boom, hang=hang, garbage=lambda: object())
    assert call_tool(tools, ToolCall("ok", {})) == ("42", False)
    text, failed = call_tool(tools, ToolCall("boom", {}))
    assert failed and "ValueError: boom" in text
    started = time.perf_counter()
    text, failed = call_tool(tools, ToolCall("hang", {}))
    assert failed and "did not return within 0.5 s" in text and time.perf_counter() - started < 5
    text, failed = call_tool(tools, ToolCall("garbage", {}))
    assert failed and "not text or JSON data" in text
    text, failed = call_tool(tools, ToolCall("missing", {}))
    assert failed and "unknown tool 'missing'" in text
    text, failed = call_tool(tools, ToolCall("ok", {"unexpected": 1}))
    assert failed and "unexpected" in text
    assert call_tool(tools, ToolCall(None, None, "bad JSON")) == ("Error: bad JSON", True)


LIMITS = {"timeout_s": 3.0, "memory_bytes": 256 * 1024**2, "cpu_seconds": 2}


def test_sandboxed_calculator_and_python():
    assert run_sandboxed("calculator", {"expression": "123*456"}, **LIMITS) == "56088"
    assert run_sandboxed("calculator", {"expression": "(2+3)^2 / 5"}, **LIMITS) == "5"
    assert run_sandboxed("python", {"code": "print(sum(range(10)))"}, **LIMITS) == "45\n"
    with pytest.raises(SandboxError, match="unsupported expression element"):
        run_sandboxed("calculator", {"expression": "__import__('os')"}, **LIMITS)
    with pytest.raises(SandboxError, match="exponent"):
        run_sandboxed("calculator", {"expression": "9**9**9"}, **LIMITS)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("while True: pass", "timed out|killed by signal"),  # wall clock or CPU limit, whichever the load hits first
        ("import os; os._exit(3)", "exited with code 3"),  # a crash
        ("x = bytearray(2 * 1024**3)", "MemoryError"),  # over RLIMIT_AS
        ("import sys; sys.stdout = sys.__stdout__; print('not json'); import os; os._exit(0)", "unreadable output"),
        ("raise KeyError('k')", "KeyError"),
        # RLIMIT_NPROC = 0 alone lets root fork; the audit hook refuses it for any user.
        ("import os; os.fork()", "os.fork is not allowed in the sandbox"),
        ("import subprocess; subprocess.run(['true'])", "is not allowed in the sandbox"),
        ("import ctypes", "import is not allowed in the sandbox"),
    ],
)
def test_sandboxed_python_failures_become_error_observations(code, message):
    tool = sandboxed_tool("python", **LIMITS)
    text, failed = call_tool({"python": tool}, ToolCall("python", {"code": code}))
    assert failed and text.startswith("Error: python"), text
    assert __import__("re").search(message, text), text


def test_tool_environment_runs_the_calls_of_a_turn():
    environment = ToolEnvironment(
        {"calculator": sandboxed_tool("calculator", **LIMITS), "echo": _tools(echo=lambda text: text)["echo"]}
    )
    row = {
        "prompt": [{"role": "user", "content": "12*34?"}],
        "extra_info": {"tools": [{"type": "function", "function": {"name": "calculator"}}]},
    }
    assert environment.reset(row) == row["prompt"]
    assert set(environment.tools) == {"calculator"}  # the row's list, not every tool
    result = environment.step(
        row["prompt"],
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
        '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>',
    )
    assert not result.done
    assert result.observations[0] == {"role": "tool", "content": "408", "tool_call_id": "call00000"}
    assert result.observations[1]["content"].startswith("Error: unknown tool 'echo'")
    assert result.observations[1]["tool_call_id"] == "call00001"  # ids count a trajectory's calls, failed or not
    assert environment.metrics() == {"tool_calls": 2.0, "tool_errors": 1.0}
    assert environment.step(row["prompt"], "408").done
    with pytest.raises(ValueError, match="does not have"):
        environment.reset({"prompt": "x", "extra_info": {"tools": ["search"]}})


def test_tool_call_ids_are_nine_letters_and_digits():
    ids = [tool_call_id(index) for index in (0, 1, 99_999)]
    assert ids == ["call00000", "call00001", "call99999"]
    assert all(len(id_) == 9 and id_.isalnum() for id_ in ids)  # what Mistral's templates require
    with pytest.raises(ValueError, match="outside 0..99999"):
        tool_call_id(100_000)


def test_rollout_config_keys_are_checked():
    from spmd_rlhf.config import ConfigError, RolloutConfig

    assert RolloutConfig(environment="tool", max_turns=3, max_new_tokens=8).response_length == 24
    assert RolloutConfig(environment="tool", max_turns=3, max_response_tokens=100).response_length == 100
    assert RolloutConfig(max_new_tokens=8).response_length == 8
    for fields, message in [
        ({"max_turns": 2}, "max_turns=2: needs rollout.environment"),
        ({"environment": "search"}, "environment=search: must be null, tool, or path/to/file.py:name"),
        (
            {"environment": "tool", "max_response_tokens": 4, "max_new_tokens": 8},
            "max_response_tokens=4: must be null or at least",
        ),
        ({"environment": "tool", "max_turns": 0}, "max_turns=0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RolloutConfig(**fields)
