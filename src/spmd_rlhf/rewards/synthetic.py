"""The rule rewards and cost of the synthetic tasks (``data_source`` ``synthetic/...``): the arithmetic task, the
tool task and the Safe-RLHF demo's cost. The tasks' rows are built by the tiny fixture (``spmd_rlhf.tiny.task``);
their scores live here, with the other rules, so scoring never imports the fixture."""

from __future__ import annotations

import re

CORRECT_REWARD = 1.0
WRONG_INTEGER_REWARD = 0.1
NO_INTEGER_REWARD = 0.0

_INTEGER = re.compile(r"-?\d+")
_TOOL_CALL_END = "</tool_call>"


def score_arithmetic(solution_str: str, ground_truth: str) -> float:
    """Rule reward for the arithmetic task; `solution_str` is the decoded response, `ground_truth` the sum as text.

    The answer is the first integer in the response (an optional minus sign and digits; text and whitespace around it
    are ignored):

    - 1.0 when that integer equals the ground truth ("7", " 7\\n", "7 is the answer" for "7");
    - 0.1 when the response holds an integer but the first one is wrong ("8", "-7", "8 or 7"): shaping that rewards
      answering with a number, so a random-init policy gets a signal long before it first hits the right sum;
    - 0.0 when the response holds no integer at all.
    """
    match = _INTEGER.search(solution_str)
    if match is None:
        return NO_INTEGER_REWARD
    return CORRECT_REWARD if int(match.group()) == int(ground_truth) else WRONG_INTEGER_REWARD


def score_tool_product(solution_str: str, ground_truth: str) -> float:
    """Rule reward for the tool_products task: ``score_arithmetic`` of the final answer, the text after the last
    ``</tool_call>`` (the whole response when it called no tool). The policy's text is all it generated, tool calls
    included, but never the tool's output (observation tokens are not the policy's): the product must be restated."""
    return score_arithmetic(solution_str.rpartition(_TOOL_CALL_END)[2], ground_truth)


_LETTER = re.compile(r"[A-Za-z]")


def cost_arithmetic(solution_str: str) -> float:
    """Rule cost for the arithmetic task (the Safe-RLHF demo's stand-in for a cost model): 1.0 when the response
    contains a Latin letter (words are off-limits in an answer), else 0.0. Most random-init responses do; a policy
    can avoid them and still answer."""
    return 1.0 if _LETTER.search(solution_str) else 0.0
