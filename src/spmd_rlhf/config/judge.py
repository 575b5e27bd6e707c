"""What a generative judge's template and score pattern must hold (``reward.kind=generative``): checked when the config
is read, so a template the judge could never be given, or a pattern that could never yield a score, stops the run at
start. The judge itself is ``spmd_rlhf.rewards.judge``."""

from __future__ import annotations

import re
import string

JUDGE_FIELDS = ("prompt", "response", "reference")
"""The names a judge template may use: the policy's prompt, its response and the row's reference answer."""

DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the prompt from 0 (wrong or useless) to 10 (correct and helpful).\n\n"
    "Prompt:\n{prompt}\n\nReference answer (may be empty):\n{reference}\n\nResponse:\n{response}\n\n"
    "End with the line 'Score: N'."
)


def judge_template_problem(template: str) -> str | None:
    """Why ``template`` cannot be a judge's prompt (a format string over ``JUDGE_FIELDS`` naming {response}), or
    None when it can."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        return f"is not a format string ({error}); write literal braces as {{{{ and }}}}"
    unknown = sorted({name for name in names if name not in JUDGE_FIELDS})
    if unknown:
        return f"names {', '.join(unknown)}; a judge template may name only {{prompt}}, {{response}} and {{reference}}"
    if "response" not in names:
        return "does not name {response}: the judge would never see what it scores; add it"
    return None


def score_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot read a score (it must compile and have a group), or None when it can."""
    try:
        groups = re.compile(pattern).groups
    except re.error as error:
        return f"is not a regular expression ({error})"
    if groups < 1:
        return r"has no group; put the score in parentheses, e.g. Score:\s*(\d+)"
    return None
