"""GSM8K-style final-answer checking: the response's final number against the ground truth's.

The final answer is, in order of preference:

1. the number after the last ``####`` (GSM8K's own format: ``... so she has 18 left.\\n#### 18``);
2. else the last number inside the last ``\\boxed{...}``;
3. else, unless ``strict``, the last number anywhere in the response.

Numbers may carry thousands commas, a dollar sign, a minus sign and decimals; they compare exactly as fractions, so
``$1,234.00`` answers ``1234`` and ``72.0`` answers ``72``, while ``72.5`` does not.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from spmd_rlhf.rewards.extract import NUMBER, last_boxed, parse_number

_MARKED = re.compile(rf"####\s*(?:\\?\$\s*)?({NUMBER})")
_ANY_NUMBER = re.compile(NUMBER)


def extract_gsm8k_answer(text: str, *, strict: bool = False) -> str | None:
    """The final answer of ``text`` as written (see the module docstring for the order), or None when it has none."""
    marked = _MARKED.findall(text)
    if marked:
        return marked[-1]
    boxed = last_boxed(text)
    numbers = _ANY_NUMBER.findall(boxed) if boxed is not None else []
    if not numbers and not strict:
        numbers = _ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_number(ground_truth: Any) -> Fraction:
    """The ground truth's number: verl's GSM8K rows hold it alone (``"72"``), GSM8K's own rows a whole solution ending
    in ``#### 72``. A ground truth that holds no number is an error naming it (a data problem, not a wrong answer)."""
    text = str(ground_truth)
    number = parse_number(extract_gsm8k_answer(text, strict=True) or text)
    if number is None:
        raise ValueError(f"the GSM8K ground truth {text[:100]!r} is neither a number nor a solution ending '#### <n>'")
    return number


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    strict: bool = False,
    format_score: float = 0.0,
) -> float:
    """1.0 when the response's final answer equals the ground truth; ``format_score`` when it has a final answer
    that is wrong (e.g. 0.1 to reward answering in the expected format); 0.0 when it has none. ``strict``: only
    ``####`` and ``\\boxed{}`` answers count (verl's ``method="strict"``), not a bare last number."""
    answer = extract_gsm8k_answer(solution_str, strict=strict)
    if answer is None:
        return 0.0
    return 1.0 if parse_number(answer) == reference_number(ground_truth) else format_score
