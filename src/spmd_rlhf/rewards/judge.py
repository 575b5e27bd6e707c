"""A generative judge's text side (``reward.kind=generative``): the judge's prompt for each response, and the score read
back from what it wrote.

    prompt     ``reward.judge_template`` formatted with {prompt} (the policy's prompt as text: a plain-text prompt as
               it is, chat messages one ``role: content`` line each, a lone user message its content alone),
               {response} (the response decoded without special tokens) and {reference} (the row's ground_truth as
               text; empty when it has none), then rendered as the one user message of a conversation with the
               judge's own chat template and its generation prompt
    score      the first group of the last match of ``reward.judge_score_pattern`` in the judge's output, as a number,
               mapped from ``reward.judge_score_range`` [low, high] to [0, 1]; an output the pattern does not match,
               whose group is not a number, or whose number lies outside the range is *unparsed*: it gets
               ``reward.judge_fallback_score`` and is counted (``<role>/judge_unparsed``)

The judge's generation itself runs on the reward role's ranks (``workers.judge``).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from spmd_rlhf.config import ScoringRoleConfig

logger = logging.getLogger(__name__)


def prompt_text(raw_prompt: str | list[dict[str, Any]]) -> str:
    """A row's prompt as the judge reads it: plain text as it is; one user message, its content; several messages,
    one ``role: content`` line each."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    if len(raw_prompt) == 1 and raw_prompt[0].get("role") == "user":
        return str(raw_prompt[0]["content"])
    return "\n".join(f"{message['role']}: {message['content']}" for message in raw_prompt)


def reference_text(ground_truth: Any) -> str:
    """The row's reference answer as text; empty when the row has none."""
    return "" if ground_truth is None else str(ground_truth)


@dataclass(frozen=True)
class JudgeVerdicts:
    """The scores read from one batch of judge outputs."""

    scores: list[float]
    """One per output, in [0, 1] where parsed, else the fallback score."""
    unparsed: int
    """Outputs that gave no score in range: scored with the fallback."""


class JudgeParser:
    """The template and the verdict parser of one judge role (``role_config``: its ``judge_*`` keys, checked when the
    config was read)."""

    def __init__(self, role_config: ScoringRoleConfig, *, role: str) -> None:
        self.role = role
        self.template = role_config.judge_template_text
        self.pattern = re.compile(role_config.judge_score_pattern)
        self.low, self.high = role_config.judge_score_range
        self.fallback = role_config.judge_fallback_score

    def user_message(self, raw_prompt: str | list[dict[str, Any]], response: str, ground_truth: Any) -> str:
        """The template filled in for one response (the module docstring)."""
        return self.template.format(
            prompt=prompt_text(raw_prompt), response=response, reference=reference_text(ground_truth)
        )

    def score(self, output: str) -> float | None:
        """The normalised score in ``output`` (the module docstring), or None when it gives none in range."""
        matches = list(self.pattern.finditer(output))
        if not matches:
            return None
        try:
            value = float(matches[-1].group(1))
        except (TypeError, ValueError):  # the group did not take part in the match, or is not a number
            return None
        if not math.isfinite(value) or not self.low <= value <= self.high:
            return None
        return (value - self.low) / (self.high - self.low)

    def verdicts(self, outputs: list[str]) -> JudgeVerdicts:
        """Every output's score, the fallback where it did not parse (the first such output logged)."""
        parsed = [self.score(output) for output in outputs]
        unparsed = [output for output, score in zip(outputs, parsed) if score is None]
        if unparsed:
            logger.warning(
                "%s: %d of %d judge outputs gave no score in [%g, %g] (scored %g), e.g. %r",
                self.role,
                len(unparsed),
                len(outputs),
                self.low,
                self.high,
                self.fallback,
                unparsed[0][:200],
            )
        scores = [self.fallback if score is None else score for score in parsed]
        return JudgeVerdicts(scores, sum(score is None for score in parsed))
