"""Finding answers in text, shared by the answer-checking rewards: brace groups, the last ``\\boxed{...}``, numbers."""

from __future__ import annotations

import re
from fractions import Fraction

NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
"""A number as written in text: optional minus, digits with optional thousands commas (``1,234``), optional
decimals; ``.5`` too. A trailing sentence period (``42.``) is not part of it; ``1,2`` is two numbers."""

_NUMBER_TEXT = re.compile(rf"(?:{NUMBER})\.?")
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_ONE_TOKEN = re.compile(r"\s+([^\s$]+)")


def read_group(text: str, start: int) -> tuple[str, int] | None:
    """The content of the brace group that opens at ``text[start]`` (which must be ``{``) and the index just past its
    closing brace; None when it never closes. Escaped braces (``\\{``, ``\\}``, literal braces in LaTeX) do not
    count towards the nesting."""
    assert text[start] == "{", "read_group must start at an opening brace"
    depth = 0
    index = start
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index], index + 1
        index += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (nested braces balanced), or of the
    one-token form ``\\boxed 5``; None when there is none or the last one never closes (a truncated response: its
    answer is unfinished, so an earlier box does not count instead)."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :]
    opening = len(rest) - len(rest.lstrip())
    if rest[opening : opening + 1] == "{":
        group = read_group(rest, opening)
        return None if group is None else group[0]
    token = _ONE_TOKEN.match(rest)
    return token.group(1) if token else None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number when the whole of it is one number (see ``NUMBER``; surrounding whitespace and a
    trailing period allowed: ``" 1,234.50 "`` is 2469/2, ``"42."`` is 42, ``".5"`` is 1/2); else None."""
    text = text.strip()
    if not _NUMBER_TEXT.fullmatch(text):
        return None
    return Fraction(text.rstrip(".").replace(",", ""))
