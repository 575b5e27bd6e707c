"""Token-exact turns across chat templates: a trajectory built from generated tokens plus observation deltas equals
the template's own rendering of the conversation where the template keeps earlier turns as they were (ChatML as the
tiny models ship it, Qwen2.5 with tools, Llama 3, Mistral), and keeps the generated tokens where the template would
rewrite them (Qwen3 drops earlier turns' <think>); a template that rewrites earlier text is refused."""

from __future__ import annotations

import copy

import pytest

from spmd_rlhf.envs import ChatDelta, TemplateDeltaError, TrajectoryDriftError, check_prefix_extension
from spmd_rlhf.tiny.task import task_corpus
from spmd_rlhf.tiny.tokenizer import CHAT_TEMPLATE, train_tokenizer

QWEN25 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's rule: an assistant turn before the last user query loses its <think>...</think> block.
QWEN3 = (
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_query and '</think>' in m.content %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) "
    "+ '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL = (
    "{{- '<s>' }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '[INST] ' + m.content + ' [/INST]' }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS] ' + m.content + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- ' ' + m.content + '</s>' }}{%- endif %}{%- endfor %}"
)
# Rewrites its header whenever a message is added: no delta can exist.
COUNTING = "{{- messages|length|string + ' messages\\n' }}" + CHAT_TEMPLATE

SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]


@pytest.fixture(scope="module")
def base_tokenizer():
    corpus = task_corpus("arithmetic") + [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
        "<think>I should use the calculator.</think>",
        "<tool_response>408</tool_response>",
    ]
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *SPECIALS]})
    return tokenizer


def _tokenizer(base, template):
    tokenizer = copy.deepcopy(base)
    tokenizer.chat_template = template
    return tokenizer


TURNS = [
    "<think>I should use the calculator.</think>"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
    "<think>It said 408.</think>The answer is 408.",
]


def _trajectory(tokenizer, messages, *, lead: str = ""):
    """Prompt tokens, then per turn the 'generated' tokens (the turn's text encoded, plus the end-of-turn token) and
    the observation's delta: what the rollout loop builds, guarded as it guards. ``lead``: what the model writes
    before the message content (Mistral's templates put a space after [/INST])."""
    delta = ChatDelta(tokenizer)
    tokens = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    generated_mask = [0] * len(tokens)
    conversation = list(messages)
    for turn, text in enumerate(TURNS):
        before = list(tokens)
        generated = tokenizer.encode(lead + text, add_special_tokens=False) + [delta.turn_end_id]
        tokens += generated
        generated_mask += [1] * len(generated)
        conversation.append({"role": "assistant", "content": text})
        if turn + 1 < len(TURNS):
            observation = [{"role": "tool", "content": "408"}]
            ids = delta.observation_ids(observation)
            tokens += ids
            generated_mask += [0] * len(ids)
            conversation += observation
        check_prefix_extension(before, tokens, where=f"turn {turn}")
    return tokens, generated_mask, conversation, delta


@pytest.mark.parametrize(
    "template", [CHAT_TEMPLATE, QWEN25, LLAMA3, MISTRAL], ids=["chatml", "qwen2.5", "llama3", "mistral"]
)
def test_trajectory_equals_the_templates_rendering(base_tokenizer, template):
    tokenizer = _tokenizer(base_tokenizer, template)
    messages = [{"role": "user", "content": "What is 12*34?"}]
    lead = " " if template == MISTRAL else ""
    tokens, mask, conversation, delta = _trajectory(tokenizer, messages, lead=lead)
    rendered = tokenizer.encode(tokenizer.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
    # The rendering goes on past the last end-of-turn token with what the template puts between turns.
    assert rendered == tokens + tokenizer.encode(delta.after_turn_end, add_special_tokens=False)
    # The mask covers exactly the generated tokens: each turn's text and its end-of-turn token.
    generated = [token for token, bit in zip(tokens, mask) if bit]
    assert generated == [
        token
        for text in TURNS
        for token in tokenizer.encode(lead + text, add_special_tokens=False) + [delta.turn_end_id]
    ]


def test_think_stripping_template_keeps_the_generated_tokens(base_tokenizer):
    tokenizer = _tokenizer(base_tokenizer, QWEN3)
    messages = [{"role": "user", "content": "What is 12*34?"}]
    tokens, mask, conversation, delta = _trajectory(tokenizer, messages)
    as_generated = tokenizer.encode(
        _tokenizer(base_tokenizer, QWEN25).apply_chat_template(conversation, tokenize=False), add_special_tokens=False
    )
    assert tokens + tokenizer.encode(delta.after_turn_end, add_special_tokens=False) == as_generated
    # Had the next turn started from a re-rendered history with a new user message, the first turn's <think> would be
    # gone from under the policy: that is what building from deltas prevents.
    rerendered = tokenizer.apply_chat_template(conversation + [{"role": "user", "content": "Thanks"}], tokenize=False)
    assert "I should use the calculator." not in rerendered
    assert "I should use the calculator." in tokenizer.decode(tokens)


def test_template_that_rewrites_earlier_text_is_refused(base_tokenizer):
    delta = ChatDelta(_tokenizer(base_tokenizer, COUNTING))
    with pytest.raises(TemplateDeltaError, match="changes how the chat template renders"):
        delta.observation_ids([{"role": "tool", "content": "408"}])


def test_guard_fails_loudly_on_drift():
    check_prefix_extension([1, 2, 3], [1, 2, 3, 4], where="ok")
    with pytest.raises(TrajectoryDriftError, match="first difference at token 1"):
        check_prefix_extension([1, 2, 3], [1, 5, 3, 4], where="turn 1")
    with pytest.raises(TrajectoryDriftError):
        check_prefix_extension([1, 2, 3], [1, 2], where="turn 2")
