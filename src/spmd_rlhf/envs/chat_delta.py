"""Token-exact turns: the tokens of observation messages as the chat template's delta after an assistant turn, and
the guard that a trajectory's tokens only ever grow at their end.

A trajectory's tokens are the prompt, then per turn the tokens the policy sampled (kept as sampled, never decoded and
re-encoded) and the observation's delta. The delta is read off the template with placeholder messages, never the real
history: render ``[user, assistant]`` and ``[user, assistant, *observations]`` (the second with the next assistant
turn opened); the second must start with the first, and what follows, after whatever the template puts between the
assistant's end-of-turn token and the next message, is the delta. Since the real history is never rendered again, a
template that rewrites earlier turns (Qwen3 drops the ``<think>`` blocks of earlier assistant turns) cannot change the
tokens under the policy, and a re-tokenization can never merge a generated token with its neighbours.
"""

from __future__ import annotations

from typing import Any

_USER = "Placeholder question."
_ASSISTANT = "Placeholder answer."


class TemplateDeltaError(ValueError):
    """The chat template cannot append observations to a conversation without changing what it already rendered."""


class TrajectoryDriftError(RuntimeError):
    """A trajectory's tokens changed somewhere other than at their end."""


def check_prefix_extension(before: list[int], after: list[int], *, where: str) -> None:
    """Raise ``TrajectoryDriftError`` unless ``after`` is ``before`` followed by zero or more tokens."""
    if after[: len(before)] != before:
        mismatch = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise TrajectoryDriftError(
            f"{where}: the trajectory's tokens are not an extension of the previous turn's ({len(before)} tokens "
            f"before, {len(after)} after, first difference at token {mismatch}); generated tokens must never be "
            f"re-tokenized"
        )


class ChatDelta:
    """Observation messages -> the token ids that follow an assistant turn ended by ``turn_end_id``."""

    def __init__(self, tokenizer, *, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        self.base_messages = base
        self.base_text = self._render(base, add_generation_prompt=False)
        end = self.base_text.rfind(_ASSISTANT)
        if end < 0:
            raise TemplateDeltaError("the chat template does not render an assistant message's content as given")
        tail = self.base_text[end + len(_ASSISTANT) :]
        tail_ids = tokenizer.encode(tail, add_special_tokens=False)
        if not tail_ids:
            raise TemplateDeltaError(
                "the chat template ends an assistant message with no end-of-turn token, so a turn's end cannot be told "
                "from its tokens; use a template that closes assistant turns (e.g. with the EOS token)"
            )
        self.turn_end_id = tail_ids[0]
        """The token that ends an assistant turn in this template (``<|im_end|>``, ``<|eot_id|>``, ``</s>``)."""
        self.after_turn_end = tail[len(tokenizer.decode([self.turn_end_id])) :]
        """What the template puts between that token and the next message (ChatML: a newline)."""

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def observation_text(self, observations: list[dict[str, Any]]) -> str:
        """The text that follows the end-of-turn token: the observations and the next assistant turn's opening."""
        full = self._render(self.base_messages + list(observations), add_generation_prompt=True)
        if not full.startswith(self.base_text):
            raise TemplateDeltaError(
                f"appending {[message['role'] for message in observations]} messages changes how the chat template "
                f"renders the conversation before them, so no token-exact delta exists; the template must only append"
            )
        return self.after_turn_end + full[len(self.base_text) :]

    def observation_ids(self, observations: list[dict[str, Any]]) -> list[int]:
        """``observation_text`` as token ids. They follow a special token (the end of turn), at which the tokenizer's
        pre-tokenization always splits, so they are the ids the whole conversation would have there."""
        return self.tokenizer.encode(self.observation_text(observations), add_special_tokens=False)
