"""Token-exact turns across chat templates. The templates here are our own, each reproducing a behaviour of a family's
published template: ChatML as the tiny models ship it; Qwen2.5's tool responses and tools in the system message;
Qwen3's think blocks (kept after the last user query, stripped before it, an empty one on the last assistant message
that goes once a message follows) with thinking on and off, and the thinking-only variant whose generation prompt
opens the block; Llama 3's tools in the first user message and ``ipython`` role; Mistral's tools and system message
moved in front of the last user message and its nine-character tool_call_id; Llama 2's ``' ' + content + ' ' +
eos``; and two that rewrite by design. Each either builds trajectories equal to its own rendering of the whole
conversation, token for token, or is refused when ``ChatDelta`` is made (at the start of a run), with the reason."""

from __future__ import annotations

import copy
import math

import pytest
from jinja2 import TemplateError

from spmd_rlhf.envs import (
    ChatDelta,
    TemplateDeltaError,
    Tool,
    ToolEnvironment,
    TrajectoryDriftError,
    check_prefix_extension,
    format_tool_call,
)
from spmd_rlhf.envs.chat_delta import template_context
from spmd_rlhf.tiny.task import task_corpus
from spmd_rlhf.tiny.tokenizer import CHAT_TEMPLATE, train_tokenizer

# Jinja pieces the templates share: a leading system message split off, a system block with tools, consecutive tool
# messages as one user message of <tool_response> blocks.
_SPLIT_SYSTEM = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}"
)
_SYSTEM_WITH_TOOLS = (
    "{%- if system is not none or tools %}{{- '<|im_start|>system\\n' + (system or '') }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
_TOOL_RESPONSES = (
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
_CHATML_MESSAGE = "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"

QWEN25 = (
    _SPLIT_SYSTEM
    + "{%- if system is none %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}"
    + _SYSTEM_WITH_TOOLS
    + "{%- for m in rest %}{%- if m.role == 'tool' %}"
    + _TOOL_RESPONSES
    + "{%- else %}"
    + _CHATML_MESSAGE
    + "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_QWEN3_MESSAGES = (
    _SPLIT_SYSTEM + _SYSTEM_WITH_TOOLS + "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in rest %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in rest %}{%- if m.role == 'assistant' %}"
    "{%- set answer = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in m.content %}"
    "{%- set answer = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- set reasoning = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- endif %}"
    # After the last user query a turn keeps its reasoning, and the last message shows a block even when empty.
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}" + _TOOL_RESPONSES + "{%- else %}" + _CHATML_MESSAGE + "{%- endif %}{%- endfor %}"
)
QWEN3 = (
    _QWEN3_MESSAGES + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN3_THINKING = (
    _QWEN3_MESSAGES + "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    + _SPLIT_SYSTEM
    + "{%- if system is not none or tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n\\n' }}{%- endif %}{{- (system or '') + '<|eot_id|>' }}{%- endif %}"
    "{%- for m in rest %}{%- if m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if tools and loop.first and m.role == 'user' %}{{- 'Functions you may call:\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}{{- '\\n' }}{%- endif %}"
    "{{- m.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL = (
    _SPLIT_SYSTEM + "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in rest %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{{- '<s>' }}{%- for m in rest %}{%- if m.role == 'user' %}"
    # Only the last user message carries the tools and the system message.
    "{%- if loop.index0 == ns.last_user and tools %}"
    "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if loop.index0 == ns.last_user and system is not none %}"
    "{{- '[INST]' + system + '\\n\\n' + m.content + '[/INST]' }}"
    "{%- else %}{{- '[INST]' + m.content + '[/INST]' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 or not m.tool_call_id.isalnum() %}"
    "{{- raise_exception('a tool message needs a tool_call_id of 9 letters and digits') }}{%- endif %}"
    "{{- '[TOOL_RESULTS]{\"content\": ' + (m.content | tojson) + ', \"call_id\": \"' + m.tool_call_id + '\"}' }}"
    "{{- '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- m.content + '</s>' }}{%- endif %}{%- endfor %}"
)
LLAMA2 = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- ' ' + m.content + ' ' + eos_token }}"
    "{%- else %}{{- '<s>[INST] ' + m.content + ' [/INST]' }}{%- endif %}{%- endfor %}"
)
# Rewrites its header whenever a message is added.
COUNTING = "{{- messages|length|string + ' messages\\n' }}" + CHAT_TEMPLATE
# Numbers tool results through the conversation: each delta, rendered after placeholders, says "result 1".
NUMBERED = (
    "{%- set ns = namespace(results=0) %}{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{%- set ns.results = ns.results + 1 %}"
    "{{- '<|im_start|>tool\\nresult ' + ns.results|string + ': ' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}" + _CHATML_MESSAGE + "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]
CALCULATOR = Tool(
    "calculator",
    "Evaluates a product",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    lambda expression: str(math.prod(int(factor) for factor in expression.split("*"))),
)
TURNS = [
    "<think>\nI should use the calculator.\n</think>\n\n" + format_tool_call("calculator", {"expression": "12*34"}),
    "<think>\nCheck it once more.\n</think>\n\n" + format_tool_call("calculator", {"expression": "34*12"}),
    "<think>\nIt said 408 twice.\n</think>\n\nThe answer is 408.",
]


@pytest.fixture(scope="module")
def base_tokenizer():
    corpus = task_corpus("arithmetic") + [*TURNS, "<tool_response>408</tool_response>", "Placeholder answer."]
    tokenizer = train_tokenizer(corpus, vocab_size=400)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *SPECIALS]})
    return tokenizer


def _tokenizer(base, template):
    tokenizer = copy.deepcopy(base)
    tokenizer.chat_template = template
    return tokenizer


def _trajectory(tokenizer, delta, *, system, tools, opens_think):
    """Prompt tokens, then per turn the 'generated' tokens (the turn's text encoded, plus the end-of-turn token) and
    the tool environment's answer as the template's delta: what the rollout loop builds, guarded as it guards.
    ``opens_think``: the generation prompt opens the think block, so the policy writes from inside it."""
    environment = ToolEnvironment({"calculator": CALCULATOR})
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "12*34?"}]
    schemas = [CALCULATOR.schema()] if tools else None
    row = {"prompt": prompt, "extra_info": {"tools": schemas} if tools else {}}
    conversation, context = environment.reset(row), template_context(row)
    assert context == {"system": system, "tools": schemas}
    text = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False, add_generation_prompt=True)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    generated_mask = [0] * len(tokens)
    for turn in TURNS:
        before = list(tokens)
        turn = turn.removeprefix("<think>\n") if opens_think else turn
        generated = tokenizer.encode(turn, add_special_tokens=False) + [delta.turn_end_id]
        tokens += generated
        generated_mask += [1] * len(generated)
        result = environment.step(conversation, turn)
        conversation.append({"role": "assistant", "content": turn})
        if not result.done:
            ids = delta.observation_ids(result.observations, **context)
            tokens += ids
            generated_mask += [0] * len(ids)
            conversation += result.observations
        check_prefix_extension(before, tokens, where="turn")
    assert result.done and environment.calls == 2
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    after = delta.after_turn_end(**context)
    return tokens, generated_mask, tokenizer.encode(rendered, add_special_tokens=False), after


# id: (template, chat_template_kwargs, whether the generation prompt opens the think block)
FOLLOWED = {
    "chatml": (CHAT_TEMPLATE, {}, False),
    "qwen2.5": (QWEN25, {}, False),
    "qwen3": (QWEN3, {}, False),
    "qwen3-thinking": (QWEN3_THINKING, {}, True),
    "llama3": (LLAMA3, {}, False),
    "mistral": (MISTRAL, {}, False),
}


@pytest.mark.parametrize("context", ["bare", "system", "system+tools"])
@pytest.mark.parametrize("name", FOLLOWED)
def test_trajectory_equals_the_templates_rendering(base_tokenizer, name, context):
    template, kwargs, opens_think = FOLLOWED[name]
    tokenizer = _tokenizer(base_tokenizer, template)
    delta = ChatDelta(tokenizer, observation_roles=ToolEnvironment.observation_roles, chat_template_kwargs=kwargs)
    system = "You add numbers." if context != "bare" else None
    tokens, mask, rendered, after = _trajectory(
        tokenizer, delta, system=system, tools=context == "system+tools", opens_think=opens_think
    )
    # The rendering goes on past the last end-of-turn token with what the template puts between turns.
    assert rendered == tokens + tokenizer.encode(after, add_special_tokens=False)
    # The mask covers exactly the generated tokens: each turn's text and its end-of-turn token.
    turns = [turn.removeprefix("<think>\n") if opens_think else turn for turn in TURNS]
    assert [token for token, bit in zip(tokens, mask) if bit] == [
        token for turn in turns for token in tokenizer.encode(turn, add_special_tokens=False) + [delta.turn_end_id]
    ]
    if name == "mistral" and context == "system+tools":
        assert "[AVAILABLE_TOOLS]" in tokenizer.decode(tokens[: mask.index(1)])  # the prompt has them, once
        assert tokenizer.decode(tokens).count("[AVAILABLE_TOOLS]") == 1


@pytest.mark.parametrize("name", ["chatml", "qwen2.5", "llama3"])
def test_templates_that_only_append_take_user_observations_too(base_tokenizer, name):
    delta = ChatDelta(_tokenizer(base_tokenizer, FOLLOWED[name][0]))  # checks tool and user observations
    assert delta.observation_ids([{"role": "user", "content": "Thanks"}])


REFUSED = {
    # id: (template, chat_template_kwargs, observation roles, the reason)
    "qwen3 thinking off": (
        QWEN3,
        {"enable_thinking": False},
        ("tool",),
        r"appending \['tool'\] messages changes how the template renders the conversation before them "
        r"\('.*assistant\\n<think>\\n\\n</think>\\n\\nPlaceholder answer\..*' becomes "
        r"'.*assistant\\nPlaceholder answer\.<\|im_end\|>",
    ),
    "qwen3 user observations": (QWEN3, {}, ("tool", "user"), r"appending \['user'\] messages changes how"),
    "qwen3-thinking user observations": (
        QWEN3_THINKING,
        {},
        ("tool", "user"),
        r"appending \['user'\] messages changes",
    ),
    "mistral user observations": (
        MISTRAL,
        {},
        ("tool", "user"),
        r"appending \['user'\] messages \(with a system message\) changes how",
    ),
    "llama2": (
        LLAMA2,
        {},
        ("tool",),
        r"the first token after an assistant message's content is ' ' .*not a special token or the EOS",
    ),
    "numbered": (
        NUMBERED,
        {},
        ("tool",),
        r"with tool observations, the turns' tokens differ from its rendering of the whole conversation at token "
        r"\d+: the rendering has '2: .*' where the turns have '1: ",
    ),
    "counting": (
        COUNTING,
        {},
        ("tool",),
        r"its rendering of an assistant message does not continue its generation prompt "
        r"\('1 messages.*' becomes '2 messages",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_template_that_cannot_be_followed_is_refused_at_start(base_tokenizer, name):
    template, kwargs, roles, reason = REFUSED[name]
    source = f"tests/{name.replace(' ', '-')}"
    with pytest.raises(TemplateDeltaError, match=f"cannot use the chat template of {source}: {reason}"):
        ChatDelta(
            _tokenizer(base_tokenizer, template), source=source, observation_roles=roles, chat_template_kwargs=kwargs
        )


def test_mistral_needs_the_tool_environments_call_ids(base_tokenizer):
    tokenizer = _tokenizer(base_tokenizer, MISTRAL)
    messages = [{"role": "user", "content": "12*34?"}, {"role": "assistant", "content": "call"}]
    with pytest.raises(TemplateError, match="tool_call_id of 9 letters and digits"):
        tokenizer.apply_chat_template(messages + [{"role": "tool", "content": "408"}], tokenize=False)
    environment = ToolEnvironment({"calculator": CALCULATOR})
    environment.reset({"prompt": "12*34?"})
    observations = environment.step(messages, TURNS[0]).observations
    assert observations[0]["tool_call_id"] == "call00000"
    assert 'call_id": "call00000"' in tokenizer.apply_chat_template(messages + observations, tokenize=False)


def test_an_unchecked_observation_role_is_an_error(base_tokenizer):
    delta = ChatDelta(_tokenizer(base_tokenizer, QWEN3), observation_roles=("tool",))
    with pytest.raises(TemplateDeltaError, match=r"checked at start for \['tool'\] only; add them"):
        delta.observation_ids([{"role": "user", "content": "Thanks"}])


def test_guard_fails_loudly_on_drift():
    check_prefix_extension([1, 2, 3], [1, 2, 3, 4], where="ok")
    with pytest.raises(TrajectoryDriftError, match="first difference at token 1"):
        check_prefix_extension([1, 2, 3], [1, 5, 3, 4], where="turn 1")
    with pytest.raises(TrajectoryDriftError):
        check_prefix_extension([1, 2, 3], [1, 2], where="turn 2")
