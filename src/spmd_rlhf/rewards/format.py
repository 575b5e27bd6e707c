"""Format rewards: whether a response is laid out as asked, whatever its answer. Each returns 1.0 or 0.0.

They have verl's signature, so they serve alone (``reward.rule=format/think_answer``) or added to a correctness
reward in a small user file (see ``spmd_rlhf.rewards``).
"""

from __future__ import annotations

import re
from typing import Any

from spmd_rlhf.rewards.extract import last_boxed

_THINK_THEN_ANSWER = re.compile(r"\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)", re.DOTALL)
_ANSWER_TAGS = re.compile(r"<answer>(?P<answer>.*)</answer>", re.DOTALL)
_TAG = re.compile(r"</?(?:think|answer)>")


def think_answer_format(
    data_source: str, solution_str: str, ground_truth: Any = None, extra_info: dict | None = None
) -> float:
    """1.0 when the response is one non-empty ``<think>...</think>`` block, first, followed by a non-empty answer,
    either bare or wrapped in one ``<answer>...</answer>`` that ends the response; 0.0 otherwise (no or several
    think blocks, text before ``<think>``, an empty thought or answer, stray tags).

    The response must hold its own ``<think>``: with a chat template that opens the think block in the prompt, use a
    user function that prepends it."""
    match = _THINK_THEN_ANSWER.fullmatch(solution_str)
    if match is None or not match["thought"].strip() or _TAG.search(match["thought"]):
        return 0.0
    answer = match["answer"].strip()
    wrapped = _ANSWER_TAGS.fullmatch(answer)
    if wrapped is not None:
        answer = wrapped["answer"].strip()
    return 1.0 if answer and not _TAG.search(answer) else 0.0


def boxed_format(
    data_source: str, solution_str: str, ground_truth: Any = None, extra_info: dict | None = None
) -> float:
    """1.0 when the response's last ``\\boxed{...}`` is closed and not empty (see ``last_boxed``); else 0.0."""
    answer = last_boxed(solution_str)
    return 1.0 if answer is not None and answer.strip() else 0.0
