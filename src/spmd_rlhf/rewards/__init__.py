"""Rule-based rewards: functions with verl's signature, chosen by name, by each row's ``data_source``, or from a file.

    def my_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict, **kwargs) -> float | dict: ...

A function returns the score, or a dict with a ``"score"`` entry plus extra numbers that become metrics
(``reward/<key>/mean``; non-numeric entries are left out). ``reward.rule`` in the config selects one of:

- ``auto``: the registered function for each row's ``data_source`` (``RULES``);
- a registered name: that function for every row;
- ``path/to/file.py:function``: a user function loaded from a file, verl's ``custom_reward_function`` style.

``reward.rule_kwargs`` are passed to every call (verl's ``reward_kwargs``), e.g. ``{strict: true, format_score: 0.1}``.

Registered rules:

- ``openai/gsm8k``, ``gsm8k``: ``gsm8k_score``, the final number (``#### 42``, else ``\\boxed{42}``, else unless
  ``strict`` the last number) against the ground truth; ``format_score`` for a wrong answer;
- ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``, ``math``: ``math_score``,
  the last ``\\boxed{}`` against the ground truth after normalising both; ``format_score`` for a wrong answer;
- ``code``, ``codecontests``, ``apps``, ``taco``, ``codeforces``, ``livecodebench``: ``code_score``, the response's
  last ```` ```python ```` block run against the row's tests (stdin/stdout, call-based or assert-style), each in a
  limited child process; the share that pass (``all_or_nothing`` for 1/0), with counts per outcome (``passed``,
  ``wrong_answer``, ``runtime_error``, ``syntax_error``, ``timeout``, ``memory``, ``output_limit``) as metrics;
- ``format/think_answer``, ``format/boxed``: 1 when the response is laid out as ``<think>...</think>`` then an
  answer, or holds a ``\\boxed{}`` answer;
- ``synthetic/arithmetic``, ``synthetic/arithmetic_cost``: the synthetic task of ``spmd_rlhf.tiny.task``, its score
  and the Safe-RLHF demo's cost;
- ``synthetic/tool_products``: the multi-turn tool task's score of the answer after the last tool call.

Correctness and format combine in a user file (``reward.rule=my_reward.py:score``)::

    from spmd_rlhf.rewards import math_score, think_answer_format

    def score(data_source, solution_str, ground_truth, extra_info):
        correct = math_score(data_source, solution_str, ground_truth, extra_info)
        layout = think_answer_format(data_source, solution_str, ground_truth, extra_info)
        return {"score": correct + 0.1 * layout, "correct": correct, "format": layout}

``RewardRunner`` scores many rows inline or in worker processes, each call under a timeout, with failures (raised,
timed out, non-finite) counted, logged and either scored 0 or raised (``on_error``). ``RemoteReward``
(``reward.kind=remote``) instead POSTs them to a scoring service, with its failures handled the same way.
"""

from spmd_rlhf.rewards.code import CODE_DATA_SOURCES, code_score
from spmd_rlhf.rewards.extract import last_boxed, parse_number
from spmd_rlhf.rewards.format import boxed_format, think_answer_format
from spmd_rlhf.rewards.gsm8k import extract_gsm8k_answer, gsm8k_score
from spmd_rlhf.rewards.math_answers import MATH_DATA_SOURCES, math_equal, math_score, normalize_math_answer
from spmd_rlhf.rewards.registry import (
    RULES,
    NonFiniteReward,
    RewardFunction,
    RuleReward,
    arithmetic,
    arithmetic_cost,
    load_function,
    parse_score,
)
from spmd_rlhf.rewards.remote import RemoteReward
from spmd_rlhf.rewards.runner import (
    RewardError,
    RewardOutcome,
    RewardRow,
    RewardRunner,
    RewardScores,
    check_failure_fraction,
)

__all__ = [
    "CODE_DATA_SOURCES",
    "MATH_DATA_SOURCES",
    "NonFiniteReward",
    "RULES",
    "RemoteReward",
    "RewardError",
    "RewardFunction",
    "RewardOutcome",
    "RewardRow",
    "RewardRunner",
    "RewardScores",
    "RuleReward",
    "arithmetic",
    "check_failure_fraction",
    "code_score",
    "arithmetic_cost",
    "boxed_format",
    "extract_gsm8k_answer",
    "gsm8k_score",
    "last_boxed",
    "load_function",
    "math_equal",
    "math_score",
    "normalize_math_answer",
    "parse_number",
    "parse_score",
    "think_answer_format",
]
