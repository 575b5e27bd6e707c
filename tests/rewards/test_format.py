"""Format rewards: a think block then an answer; a boxed answer."""

from __future__ import annotations

import pytest

from spmd_rlhf.rewards import RULES, boxed_format, think_answer_format


@pytest.mark.parametrize(
    "response, score",
    [
        ("<think>3 + 4 is 7</think> The answer is 7.", 1.0),
        ("  <think>\nadd them\n</think>\n<answer>7</answer>\n", 1.0),
        ("<think>add</think><answer> 7 </answer>", 1.0),
        ("The answer is 7.", 0.0),  # no think block
        ("Let me see. <think>add</think> 7", 0.0),  # text before the think block
        ("<think>add</think>", 0.0),  # no answer
        ("<think>   </think> 7", 0.0),  # empty thought
        ("<think>add</think><answer> </answer>", 0.0),  # empty answer
        ("<think>add</think> 7 <think>again</think> 8", 0.0),  # two think blocks
        ("<think>add <think> nested</think> 7", 0.0),
        ("<think>add</think><answer>7</answer> and more", 0.0),  # text after the answer tags
        ("<think>add</think><answer>7", 0.0),  # unclosed answer tag
        ("<think>add and never stop", 0.0),  # truncated
    ],
)
def test_think_answer_format(response, score):
    assert think_answer_format("any", response, None, {}) == score


@pytest.mark.parametrize(
    "response, score",
    [
        ("so $\\boxed{\\frac{1}{2}}$", 1.0),
        ("\\boxed{ }", 0.0),
        ("\\boxed{\\frac{1}{2}", 0.0),  # never closed
        ("the answer is 1/2", 0.0),
    ],
)
def test_boxed_format(response, score):
    assert boxed_format("any", response, None, {}) == score


def test_registered():
    assert RULES["format/think_answer"] is think_answer_format and RULES["format/boxed"] is boxed_format
