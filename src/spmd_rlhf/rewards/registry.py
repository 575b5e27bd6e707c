"""Which function scores a row: the built-in rules by name (``RULES``) and ``RuleReward``, which picks one by name, by
each row's ``data_source``, or from a user file, and checks what it returns."""

from __future__ import annotations

import importlib.util
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmd_rlhf.rewards.code import CODE_DATA_SOURCES, code_score
from spmd_rlhf.rewards.format import boxed_format, think_answer_format
from spmd_rlhf.rewards.gsm8k import gsm8k_score
from spmd_rlhf.rewards.math_answers import MATH_DATA_SOURCES, math_score
from spmd_rlhf.rewards.synthetic import cost_arithmetic, score_arithmetic, score_tool_product

RewardFunction = Callable[..., "float | dict[str, float]"]
"""verl's signature: ``fn(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float | dict``."""


FLOAT32_MAX = 3.4028234663852886e38
"""Scores are kept as float32 tensors: a larger finite score would become an infinity there, then NaN advantages."""


class NonFiniteReward(ValueError):
    """A reward function returned NaN or an infinity (as the score or as an extra number), or a score beyond
    float32's range."""


def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The synthetic arithmetic task: 1 for the right sum, 0.1 for a wrong integer, 0 for no integer."""
    return score_arithmetic(solution_str, str(ground_truth))


def tool_products(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The synthetic tool task: ``arithmetic``'s score of the answer after the last tool call."""
    return score_tool_product(solution_str, str(ground_truth))


def arithmetic_cost(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The synthetic arithmetic task's cost in the Safe-RLHF demo (``rewards.synthetic.cost_arithmetic``)."""
    return cost_arithmetic(solution_str)


RULES: dict[str, RewardFunction] = {
    "synthetic/arithmetic": arithmetic,
    "synthetic/arithmetic_cost": arithmetic_cost,
    "synthetic/tool_products": tool_products,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    **dict.fromkeys(MATH_DATA_SOURCES, math_score),
    **dict.fromkeys(CODE_DATA_SOURCES, code_score),
    "format/think_answer": think_answer_format,
    "format/boxed": boxed_format,
}
"""Built-in rules by name; with ``rule=auto`` a row's ``data_source`` is the name."""


def load_function(spec: str, *, name: str = "reward") -> RewardFunction:
    """``path/to/file.py:function`` as a callable; a missing file or function is an error naming it (``name``: the
    config section, for the message)."""
    path, _, function_name = spec.rpartition(":")
    if not path or not function_name:
        raise ValueError(f"{name}.rule={spec!r}: a user reward function is written path/to/file.py:function")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{name}.rule={spec!r}: {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"spmd_rlhf_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{name}.rule={spec!r}: {path} defines no function {function_name!r}")
    return function


class RuleReward:
    """Scores responses with the rule selected by ``rule`` (see ``spmd_rlhf.rewards``), passing ``kwargs`` to every
    call. A missing file, function or registered name, or ``kwargs`` the chosen function does not take, fail here."""

    def __init__(self, rule: str = "auto", kwargs: dict[str, Any] | None = None, *, name: str = "reward") -> None:
        self.kwargs = dict(kwargs or {})
        self.name = name
        self._fixed: RewardFunction | None = None
        if rule.endswith(".py") or ".py:" in rule:
            self._fixed = load_function(rule, name=name)
            path, _, function_name = rule.rpartition(":")
            rule = f"{Path(path).resolve()}:{function_name}"
        elif rule != "auto":
            if rule not in RULES:
                raise ValueError(
                    f"{name}.rule={rule!r} is not registered; choose auto, one of {sorted(RULES)}, or "
                    f"path/to/file.py:function"
                )
            self._fixed = RULES[rule]
        self.rule = rule
        """As given, with a user file's path made absolute: worker processes load the file again from there."""
        if self._fixed is not None and self.kwargs:
            try:
                inspect.signature(self._fixed).bind("", "", None, {}, **self.kwargs)
            except TypeError as error:
                raise ValueError(f"{name}.rule_kwargs: {rule} does not take {sorted(self.kwargs)}: {error}") from None

    def function_for(self, data_source: str) -> RewardFunction:
        if self._fixed is not None:
            return self._fixed
        if data_source not in RULES:
            raise ValueError(
                f"no reward rule for data_source {data_source!r}; registered: {sorted(RULES)}. Set {self.name}.rule "
                f"to a registered name or path/to/file.py:function"
            )
        return RULES[data_source]

    def describe(self, data_source: str) -> str:
        """The function that scores ``data_source``'s rows, as messages name it."""
        if self.rule != "auto":
            return self.rule
        function = RULES.get(data_source)
        return f"{function.__module__}.{function.__qualname__}" if function else f"the rule for {data_source!r}"

    def score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict
    ) -> tuple[float, dict[str, float]]:
        """(score, extra metrics) of one response, as ``parse_score`` reads the function's result."""
        result = self.function_for(data_source)(data_source, solution_str, ground_truth, extra_info, **self.kwargs)
        return parse_score(result)


def parse_score(result: Any) -> tuple[float, dict[str, float]]:
    """(score, extra metrics) of what a reward returned for one response: a number, or a dict with a ``"score"`` entry
    whose other numeric entries are the extras (others, such as a predicted answer string, are left out). A result
    that is neither raises ``ValueError`` or ``TypeError``; a non-finite score or extra, or a score beyond float32's
    range, raises ``NonFiniteReward``."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key: {result}")
        numbers = {key: value for key, value in result.items() if hasattr(type(value), "__float__")}
        extras = {key: float(value) for key, value in numbers.items() if key != "score"}
        result = result["score"]
    if isinstance(result, str | bytes):  # float() would parse "0.5": a string is not a score
        raise TypeError(f"returned {result!r}, a string, as 'score'")
    score = float(result)
    for key, value in {"score": score, **extras}.items():
        if not math.isfinite(value):
            raise NonFiniteReward(f"returned {value} as {key!r}")
    if abs(score) > FLOAT32_MAX:
        raise NonFiniteReward(
            f"returned {score} as 'score', beyond float32's range (±{FLOAT32_MAX:.4g}) in which scores are kept; "
            f"scale it down"
        )
    return score, extras
