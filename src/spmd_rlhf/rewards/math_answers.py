"""MATH-style answer checking: the response's last ``\\boxed{...}`` against the ground truth, both normalised.

``normalize_math_answer`` drops what does not change an answer and writes equal answers one way:

- spacing: whitespace, ``\\!``, ``\\,``, ``\\;``, ``\\:``, ``\\ ``, ``\\displaystyle``, ``\\left`` / ``\\right``;
- decoration: ``^\\circ`` / ``^{\\circ}`` / ``°``, ``\\%``, ``%``, ``\\$``, ``$``, a trailing sentence period;
- units: a ``\\text{...}`` (or ``\\mbox``, ``\\mathrm``, ``\\textrm``, ``\\textbf``) group that ends the answer after a
  number, with an optional power (``5\\text{ cm}^2`` -> ``5``); any other such group keeps its content
  (``\\text{(B)}`` -> ``(B)``);
- fractions and roots: ``\\dfrac`` / ``\\tfrac`` -> ``\\frac``, every argument of ``\\frac`` and ``\\sqrt`` braced as
  LaTeX reads it (``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``), ``a/b`` of integers ->
  ``\\frac{a}{b}``;
- numbers: ``.5`` -> ``0.5``, ``3.0`` -> ``3``;
- a leading simple variable: ``x = 3`` -> ``3``, ``a_1=2`` -> ``2``.

Two answers are equal when their normal forms are the same string, or when both are numbers or simple fractions of
numbers (``0.5``, ``\\frac{1}{2}``, ``-2/4``, ``1,000``) with the same exact value. Nothing symbolic is attempted:
``\\frac{\\sqrt{2}}{2}`` and ``\\frac{1}{\\sqrt{2}}`` differ.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from spmd_rlhf.rewards.extract import last_boxed, parse_number, read_group

MATH_DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
"""The data sources verl's MATH datasets use, plus the short name ``math``."""

_REMOVED = re.compile(r"\\[!,;:]|\\ |\\displaystyle|\\(?:left|right)(?![a-zA-Z])|\^\{?\\circ\}?|°|\\?%|\\?\$")
_STYLED_FRACTION = re.compile(r"\\[dt]frac(?![a-zA-Z])")
_TEXT = re.compile(r"\\(?:text|textrm|textbf|mbox|mathrm)\s*\{")
_UNIT_END = re.compile(r"\s*(?:\^\{?\d+\}?)?\s*")
_ARGUMENT_COMMANDS = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")
_CONTROL_WORD = re.compile(r"\\(?:[a-zA-Z]+|.)")
_VARIABLE_PREFIX = re.compile(r"[a-zA-Z](?:_\{?\w+\}?)?=(?!=)")
_INTEGER_RATIO = re.compile(r"(-?)(\d+)/(\d+)")
_BARE_DECIMAL = re.compile(r"(?<!\d)\.(\d)")
_ZERO_DECIMALS = re.compile(r"(\d)\.0+(?!\d)")
_SIMPLE_FRACTION = re.compile(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def normalize_math_answer(answer: str) -> str:
    """``answer``'s normal form (see the module docstring)."""
    text = _REMOVED.sub("", answer)
    text = _STYLED_FRACTION.sub(r"\\frac", text)
    text = _brace_arguments(_unwrap_text(text))
    text = "".join(text.split())
    if text.count("=") == 1 and _VARIABLE_PREFIX.match(text):
        text = text.partition("=")[2]
    text = _INTEGER_RATIO.sub(r"\1\\frac{\2}{\3}", text) if _INTEGER_RATIO.fullmatch(text) else text
    text = text[:-1] if text.endswith(".") and not text.endswith("..") else text
    text = _BARE_DECIMAL.sub(r"0.\1", text)
    return _ZERO_DECIMALS.sub(r"\1", text)


def math_equal(answer: str, reference: str) -> bool:
    """Whether two answers are equal: same normal form, or both numbers / simple fractions of the same value."""
    normal_answer, normal_reference = normalize_math_answer(answer), normalize_math_answer(reference)
    if not normal_answer:
        return False
    if normal_answer == normal_reference:
        return True
    value = _as_number(normal_answer)
    return value is not None and value == _as_number(normal_reference)


def math_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.0,
) -> float:
    """1.0 when the response's last ``\\boxed{}`` equals the ground truth (``math_equal``); ``format_score`` when it
    has a boxed answer that is wrong; 0.0 when it has none. A ground truth that is itself a solution with a
    ``\\boxed{}`` answer is reduced to that answer."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    reference = str(ground_truth)
    boxed_reference = last_boxed(reference)
    if boxed_reference is not None:
        reference = boxed_reference
    return 1.0 if math_equal(answer, reference) else format_score


def _unwrap_text(text: str) -> str:
    """``\\text{...}``-like groups: one that ends the answer after a number is a unit and goes; any other is replaced
    by its content."""
    pieces: list[str] = []
    index = 0
    while (match := _TEXT.search(text, index)) and (group := read_group(text, match.end() - 1)):
        content, end = group
        pieces.append(text[index : match.start()])
        is_unit = _UNIT_END.fullmatch(text, end) is not None and any(char.isdigit() for char in "".join(pieces))
        if is_unit:
            return "".join(pieces)
        pieces.append(content)
        index = end
    return "".join(pieces) + text[index:]


def _brace_arguments(text: str) -> str:
    """Every argument of ``\\frac`` (two) and ``\\sqrt`` (one, after an optional ``[n]``) in braces, as LaTeX reads
    them: a brace group, a control word or one character (``\\frac\\pi2`` -> ``\\frac{\\pi}{2}``)."""
    pieces: list[str] = []
    index = 0
    while match := _ARGUMENT_COMMANDS.search(text, index):
        pieces.append(text[index : match.end()])
        index = match.end()
        if match.group(1) == "sqrt" and text[index:].lstrip().startswith("["):
            close = text.find("]", index)
            if close < 0:
                break
            pieces.append(text[index : close + 1])
            index = close + 1
        for _ in range(2 if match.group(1) == "frac" else 1):
            argument = _read_argument(text, index)
            if argument is None:
                break
            content, index = argument
            pieces.append("{" + _brace_arguments(content) + "}")
    return "".join(pieces) + text[index:]


def _read_argument(text: str, index: int) -> tuple[str, int] | None:
    """The macro argument starting at ``index`` (spaces skipped) and the index after it; None at the end of the text,
    at an unclosed brace or at a lone trailing backslash."""
    while index < len(text) and text[index].isspace():
        index += 1
    if index == len(text):
        return None
    if text[index] == "{":
        return read_group(text, index)
    if text[index] == "\\":
        word = _CONTROL_WORD.match(text, index)
        return (word.group(), word.end()) if word else None
    return text[index], index + 1


def _as_number(normal: str) -> Fraction | None:
    """The exact value of a normal form that is a number or a simple fraction of numbers; else None."""
    number = parse_number(normal)
    if number is not None:
        return number
    if match := _SIMPLE_FRACTION.fullmatch(normal):
        sign, numerator, denominator = match.groups()
    elif normal.count("/") == 1:
        sign, (numerator, denominator) = "", normal.split("/")
    else:
        return None
    top, bottom = parse_number(numerator), parse_number(denominator)
    if top is None or not bottom:
        return None
    return (-top if sign else top) / bottom
