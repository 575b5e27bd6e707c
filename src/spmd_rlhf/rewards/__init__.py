"""Rule-based rewards: functions with verl's signature, chosen by name, by each row's ``data_source``, or from a file.

    def my_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict) -> float | dict: ...

A function returns the score, or a dict with a ``"score"`` entry plus extra numbers that become metrics
(``reward/<key>/mean``). ``reward.rule`` in the config selects one of:

- ``auto``: the registered function for each row's ``data_source`` (``RULES``);
- a registered name (``synthetic/arithmetic``): that function for every row;
- ``path/to/file.py:function``: a user function loaded from a file, verl's ``custom_reward_function`` style.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..data.tasks import score_arithmetic

RewardFunction = Callable[[str, str, Any, dict], "float | dict[str, float]"]


def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """The synthetic arithmetic task: 1 for the right sum, 0.1 for a wrong integer, 0 for no integer."""
    return score_arithmetic(solution_str, str(ground_truth))


RULES: dict[str, RewardFunction] = {"synthetic/arithmetic": arithmetic}
"""Registered rule rewards by data source."""


def load_function(spec: str) -> RewardFunction:
    """``path/to/file.py:function`` as a callable; a missing file or name is an error saying which."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"reward.rule={spec!r}: a user reward function is written path/to/file.py:function")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"reward.rule={spec!r}: {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"spmd_rlhf_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward.rule={spec!r}: {path} defines no function {name!r}")
    return function


class RuleReward:
    """Scores responses with the rule selected by ``rule`` (see the module docstring)."""

    def __init__(self, rule: str = "auto") -> None:
        self.rule = rule
        self._fixed: RewardFunction | None = None
        if rule.endswith(".py") or ".py:" in rule:
            self._fixed = load_function(rule)
        elif rule != "auto":
            if rule not in RULES:
                raise ValueError(f"reward.rule={rule!r} is not registered; choose auto, one of {sorted(RULES)}, or path/to/file.py:function")
            self._fixed = RULES[rule]

    def function_for(self, data_source: str) -> RewardFunction:
        if self._fixed is not None:
            return self._fixed
        if data_source not in RULES:
            raise ValueError(
                f"no reward rule for data_source {data_source!r}; registered: {sorted(RULES)}. Set reward.rule to a "
                f"registered name or path/to/file.py:function"
            )
        return RULES[data_source]

    def score(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> tuple[float, dict[str, float]]:
        """(score, extra metrics) of one response; a non-finite score is an error naming the row's data source."""
        result = self.function_for(data_source)(data_source, solution_str, ground_truth, extra_info)
        extras: dict[str, float] = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(f"the reward function for {data_source!r} returned a dict without a 'score' key: {result}")
            extras = {key: float(value) for key, value in result.items() if key != "score"}
            result = result["score"]
        score = float(result)
        if not math.isfinite(score):
            raise ValueError(f"the reward function for {data_source!r} returned {score} for response {solution_str!r:.200}")
        return score, extras
