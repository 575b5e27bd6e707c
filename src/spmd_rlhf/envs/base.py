"""The environment interface of multi-turn rollouts: the policy speaks, the environment answers with messages.

    class MyEnvironment(Environment):
        def reset(self, row: dict) -> list[dict]:                         # the conversation the policy starts from
            ...
        def step(self, messages: list[dict], new_text: str) -> StepResult:  # the policy's new turn -> observations
            ...

One environment object serves one trajectory (``make_environment`` gives a fresh one each time), so it may keep the
trajectory's state. Environments work on text and messages only: the rollout loop (``rollout.py``) owns the token
ids, turns observation messages into tokens with the chat template's delta (``chat_delta.py``) and never
re-tokenizes what the policy generated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    observations: list[dict[str, Any]] = field(default_factory=list)
    """Messages that answer the policy's turn (``{"role": "tool", "content": ...}``); rendered into the trajectory
    after it, followed by the next assistant turn's opening, unless ``done``."""
    reward: float = 0.0
    """This turn's reward; a trajectory's environment reward is the sum of its turns' plus ``trajectory_reward``."""
    done: bool = False
    """The trajectory ends after this turn (its observations, if any, are not added)."""


class Environment(ABC):
    observation_roles: tuple[str, ...] = ("tool", "user")
    """The roles of the messages ``step`` answers with. When a run starts, the chat template is checked for each
    (``chat_delta.ChatDelta``): a template that cannot append one token for token is refused then, so name only the
    roles the environment uses."""

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Start a trajectory for dataset ``row`` (verl's fields: ``prompt``, ``data_source``, ``ground_truth``,
        ``extra_info``); returns the initial messages (the row's prompt, which the policy sees as rendered by the
        dataset)."""

    @abstractmethod
    def step(self, messages: list[dict[str, Any]], new_text: str) -> StepResult:
        """The policy's new turn ``new_text`` (decoded, without special tokens) after the conversation ``messages``
        so far (initial messages, then each assistant turn and its observations)."""

    def trajectory_reward(self, messages: list[dict[str, Any]]) -> float:
        """A reward for the whole trajectory once it has ended; 0 unless overridden."""
        return 0.0

    def metrics(self) -> dict[str, float]:
        """Numbers about this trajectory to average into the step's metrics (``rollout/env/<key>``)."""
        return {}


EnvironmentFactory = Callable[[], Environment]


def initial_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's prompt as messages: chat messages as they are, plain text as one user message."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return [dict(message) for message in prompt]
    raise ValueError(f"a row's prompt must be text or chat messages to start an environment, got {prompt!r:.80}")
