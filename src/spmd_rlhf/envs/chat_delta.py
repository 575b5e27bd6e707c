"""Token-exact turns: the tokens of observation messages as the chat template's delta after an assistant turn, the
check that a template allows them, and the guard that a trajectory's tokens only ever grow at their end.

A trajectory's tokens are the prompt, then per turn the tokens the policy sampled (kept as sampled, never decoded and
re-encoded) and the observation's delta. The delta is read off the template with placeholder messages, never the real
history: render ``[system, user, assistant]`` and ``[system, user, assistant, *observations]`` (the second with the
next assistant turn opened), both with the trajectory's system message (if it has one) and tools, because templates
move them about (Mistral's put the tools and the system message in front of the *last* user message). The second
rendering must start with the first; what follows the assistant's end-of-turn token is the delta. Since the real
history is never rendered again, a re-tokenization can never merge a generated token with its neighbours.

A template is checked once, when ``ChatDelta`` is made (at the start of a run): for each context (with and without a
system message, with and without tools) and each role the environment answers with, a synthetic three-turn
conversation built the way a rollout builds it (the prompt, each turn as the policy writes it, i.e. what the template
puts after its generation prompt, then its end-of-turn token and the observation's delta) must equal the template's
rendering of the whole conversation token for token. A template that fails is refused there, with the tokenizer's
source and the reason, instead of in the middle of a rollout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from spmd_rlhf.data.dataset import template_tools
from spmd_rlhf.envs.tools import tool_call_id

_SYSTEM = "Placeholder system message."
_USER = "Placeholder question."
_ANSWER = "Placeholder answer."
# A reasoning model writes a think block before its answer. Templates of the Qwen3 kind render the last assistant
# message with an (empty, without one) think block and drop an empty block once a message follows, so the turns are
# placeholders with reasoning, where the template's generation prompt allows it.
_REASONING = "<think>\nPlaceholder reasoning.\n</think>\n\n"
_TOOL = {
    "type": "function",
    "function": {
        "name": "placeholder_tool",
        "description": "A placeholder tool.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
_CONTEXTS = ((None, None), (_SYSTEM, None), (None, [_TOOL]), (_SYSTEM, [_TOOL]))
"""(system message, tools) of the checked conversations."""
_CHECKED_TURNS = 3
_ADVICE = (
    "use a template that renders earlier messages the same whatever follows (model.tokenizer_path), or an environment "
    "whose observation_roles leave out this role"
)


class TemplateDeltaError(ValueError):
    """The chat template cannot append observations to a conversation without changing what it already rendered."""


class TrajectoryDriftError(RuntimeError):
    """A trajectory's tokens changed somewhere other than at their end."""


def check_prefix_extension(before: list[int], after: list[int], *, where: str) -> None:
    """Raise ``TrajectoryDriftError`` unless ``after`` is ``before`` followed by zero or more tokens."""
    if after[: len(before)] != before:
        raise TrajectoryDriftError(
            f"{where}: the trajectory's tokens are not an extension of the previous turn's ({len(before)} tokens "
            f"before, {len(after)} after, first difference at token {_first_difference(before, after)}); generated "
            f"tokens must never be re-tokenized"
        )


def template_context(row: dict[str, Any]) -> dict[str, Any]:
    """What a row's prompt was rendered with besides its messages, as ``observation_ids`` takes it: ``system`` (the
    content of the prompt's leading system message, or None) and ``tools`` (``dataset.template_tools`` of its
    ``extra_info.tools``)."""
    prompt = row.get("prompt")
    leading = prompt[0] if isinstance(prompt, list) and prompt else {}
    return {
        "system": leading.get("content") if leading.get("role") == "system" else None,
        "tools": template_tools((row.get("extra_info") or {}).get("tools")),
    }


class ChatDelta:
    """Observation messages -> the token ids that follow an assistant turn ended by ``turn_end_id``, after checking
    the template (module docstring); ``TemplateDeltaError`` naming ``source`` (the tokenizer's path, for messages) and
    the reason when it cannot be followed token for token. ``observation_roles``: the roles the environment answers
    with (``Environment.observation_roles``), each checked; ``chat_template_kwargs`` go to every rendering."""

    def __init__(
        self,
        tokenizer,
        *,
        source: str | None = None,
        observation_roles: Sequence[str] = ("tool", "user"),
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.source = source or getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        self.observation_roles = tuple(observation_roles)
        self.kwargs = dict(chat_template_kwargs or {})
        self._bases: dict[str, tuple[str, int]] = {}
        try:
            self.assistant_text = self._turn_text([{"role": "user", "content": _USER}], _ANSWER, None)
            """The placeholder assistant turn, as the policy would write it, that deltas are rendered after."""
            self.turn_end_id = self._find_turn_end()
            """The token that ends an assistant turn in this template (``<|im_end|>``, ``<|eot_id|>``, ``</s>``)."""
            for system, tools in _CONTEXTS:
                for role in self.observation_roles:
                    self._check_conversation(system, tools, role)
        except (TemplateDeltaError, TemplateError) as error:
            raise TemplateDeltaError(
                f"multi-turn rollouts cannot use the chat template of {self.source}: {error}"
            ) from None

    def observation_ids(
        self, observations: list[dict[str, Any]], *, system: str | None = None, tools: list[dict] | None = None
    ) -> list[int]:
        """``observation_text`` as token ids. They follow a special token (the end of turn), at which the tokenizer's
        pre-tokenization always splits, so they are the ids the whole conversation would have there."""
        return self._encode(self.observation_text(observations, system=system, tools=tools))

    def observation_text(
        self, observations: list[dict[str, Any]], *, system: str | None = None, tools: list[dict] | None = None
    ) -> str:
        """The text that follows the end-of-turn token: the observations and the next assistant turn's opening, in a
        trajectory whose prompt has the system message ``system`` and the tools ``tools`` (``template_context`` of its
        row)."""
        unchecked = sorted({message["role"] for message in observations} - set(self.observation_roles))
        if unchecked:
            raise TemplateDeltaError(
                f"an observation has the role(s) {unchecked}, but the chat template was checked at start for "
                f"{list(self.observation_roles)} only; add them to the environment's observation_roles"
            )
        base_text, cut = self._base(system, tools)
        full = self._render(self._base_messages(system) + list(observations), tools, add_generation_prompt=True)
        if not full.startswith(base_text):
            raise TemplateDeltaError(
                f"appending {[message['role'] for message in observations]} messages{_context(system, tools)} changes "
                f"how the template renders the conversation before them ({_difference(base_text, full)}), so no "
                f"token-exact delta exists; {_ADVICE}"
            )
        return full[cut:]

    def after_turn_end(self, *, system: str | None = None, tools: list[dict] | None = None) -> str:
        """What the template puts between the end-of-turn token and the next message (ChatML: a newline)."""
        base_text, cut = self._base(system, tools)
        return base_text[cut:]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _base_messages(self, system: str | None) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": system}] if system is not None else []
        return head + [{"role": "user", "content": _USER}, {"role": "assistant", "content": self.assistant_text}]

    def _turn_text(self, history: list[dict[str, Any]], answer: str, tools: list[dict] | None) -> str:
        """What the policy writes for a turn ending in ``answer`` after ``history``: what the template puts after its
        generation prompt when the assistant message is the last one, up to the end of its content."""
        prompt = self._render(history, tools, add_generation_prompt=True)
        for content in (_REASONING + answer, answer):
            rendered = self._render(
                history + [{"role": "assistant", "content": content}], tools, add_generation_prompt=False
            )
            end = rendered.rfind(answer)
            if rendered.startswith(prompt) and end >= len(prompt):
                return rendered[len(prompt) : end + len(answer)]
        raise TemplateDeltaError(
            f"its rendering of an assistant message does not continue its generation prompt "
            f"({_difference(prompt, rendered)}), so a turn's tokens cannot be told; {_ADVICE}"
        )

    def _find_turn_end(self) -> int:
        text = self._render(self._base_messages(None), None, add_generation_prompt=False)
        end = text.rfind(_ANSWER) + len(_ANSWER)
        tail_ids = self._encode(text[end:])
        if not tail_ids:
            raise TemplateDeltaError(
                "it ends an assistant message with no end-of-turn token, so a turn's end cannot be told from its "
                "tokens; use a template that closes assistant turns (e.g. with the EOS token)"
            )
        token_id = tail_ids[0]
        added = self.tokenizer.added_tokens_decoder.get(token_id)
        if not (
            token_id == self.tokenizer.eos_token_id
            or token_id in self.tokenizer.all_special_ids
            or (added is not None and added.special)
        ):
            raise TemplateDeltaError(
                f"the first token after an assistant message's content is {self.tokenizer.decode([token_id])!r} "
                f"(id {token_id}), not a special token or the EOS token, so it cannot mark the end of a turn (it would "
                f"become a stop token); the template must close an assistant message with a special token"
            )
        self._turn_end_text = self.tokenizer.decode([token_id])
        return token_id

    def _base(self, system: str | None, tools: list[dict] | None) -> tuple[str, int]:
        """The placeholder ``[system, user, assistant]`` rendering in a context, and where its end-of-turn token
        ends (one per distinct context, the oldest dropped past 1024)."""
        key = json.dumps([system, tools], sort_keys=True)
        if key not in self._bases:
            text = self._render(self._base_messages(system), tools, add_generation_prompt=False)
            end = text.rfind(_ANSWER) + len(_ANSWER)
            if not text.startswith(self._turn_end_text, end):
                raise TemplateDeltaError(
                    f"it ends an assistant message{_context(system, tools)} with {text[end : end + 24]!r}, not with "
                    f"its end-of-turn token {self._turn_end_text!r}"
                )
            if len(self._bases) >= 1024:
                self._bases.pop(next(iter(self._bases)))
            self._bases[key] = (text, end + len(self._turn_end_text))
        return self._bases[key]

    def _check_conversation(self, system: str | None, tools: list[dict] | None, role: str) -> None:
        """The synthetic conversation with ``role`` observations in a context, built as a rollout builds it, equals
        the template's whole rendering token for token (module docstring)."""
        history = self._base_messages(system)[:-1]
        try:
            prompt = self._render(history, tools, add_generation_prompt=True)
        except TemplateError:
            return  # a template that renders no such prompt: no row has one, so no rollout runs in this context
        stream = self._encode(prompt)
        for turn in range(_CHECKED_TURNS):
            generated = self._encode(self._turn_text(history, f"Placeholder answer {turn}.", tools))
            generated.append(self.turn_end_id)
            stream += generated
            # What the rollout loop keeps of a turn: its tokens decoded without special tokens.
            history.append({"role": "assistant", "content": self.tokenizer.decode(generated, skip_special_tokens=True)})
            if turn + 1 < _CHECKED_TURNS:
                observation = {"role": role, "content": f"Placeholder {role} message {turn}."}
                if role == "tool":
                    observation["tool_call_id"] = tool_call_id(turn)
                stream += self.observation_ids([observation], system=system, tools=tools)
                history.append(observation)
        stream += self._encode(self.after_turn_end(system=system, tools=tools))
        whole = self._encode(self._render(history, tools, add_generation_prompt=False))
        if whole != stream:
            at = _first_difference(whole, stream)
            rendering, turns = (self.tokenizer.decode(ids[at : at + 8]) for ids in (whole, stream))
            raise TemplateDeltaError(
                f"with {role} observations{_context(system, tools)}, the turns' tokens differ from its rendering of "
                f"the whole conversation at token {at}: the rendering has {rendering!r} where the turns have "
                f"{turns!r} (it renders a message depending on the messages around it, which the placeholders "
                f"deltas are rendered with cannot reproduce); {_ADVICE}"
            )


def _context(system: str | None, tools: list[dict] | None) -> str:
    parts = [name for name, present in (("a system message", system is not None), ("tools", tools)) if present]
    return f" (with {' and '.join(parts)})" if parts else ""


def _difference(before: str, after: str) -> str:
    """Where two renderings part, with a little of what both share before it."""
    at = _first_difference(before, after)
    start = max(0, at - 16)
    return f"{before[start : at + 40]!r} becomes {after[start : at + 40]!r}"


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
