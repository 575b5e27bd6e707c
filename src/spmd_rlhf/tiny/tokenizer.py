"""Train a small byte-level BPE tokenizer with a ChatML chat template, entirely offline.

Tests and the tiny demo models need a real Hugging Face tokenizer without downloading one from a model hub.
`train_tokenizer` fits one on a local corpus in well under a second and returns a `PreTrainedTokenizerFast` whose
`save_pretrained` directory loads back with `transformers.AutoTokenizer.from_pretrained`.

Design choices that matter for RL:

- `<|im_end|>` is the eos token, so the assistant's end of turn is exactly what the generation engine stops on and what
  the policy learns to emit; `<|pad|>` is a separate token so padding is never confused with a real end of turn.
- Digits are always single tokens (no merges across digits), so a number's tokens do not depend on its neighbours.
- No special token is added automatically on `encode` (like Qwen2): the chat template alone decides the prompt layout.

The text pipeline (NFC, Qwen2's split pattern, byte-level BPE) is exactly the one `transformers.Qwen2Tokenizer` rebuilds
around the saved vocabulary and merges: `AutoTokenizer` always loads a `model_type: qwen2` directory with that class,
whatever `tokenizer_config.json` names, so any other pipeline would give different ids for the qwen2 tiny model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
# Never produced by byte-level BPE; it is named as the unk token because Qwen2Tokenizer adds it when no unk is given,
# which would make len(tokenizer) disagree with the model's vocabulary. Like Qwen's, it can also end plain documents.
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN]

# Qwen2's pre-tokenizer pattern. Its `\p{N}` alternative isolates every digit, so BPE never merges digits.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# A second layout, for a scoring model that reads conversations unlike the policy (a reward model of another family):
# "User: 3+4=\n\nAssistant: 7\n\n", no chat markers at all.
ROLE_COLON_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message['role'] | capitalize + ': ' + message['content'] + '\\n\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- 'Assistant:' }}"
    "{%- endif %}"
)

CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "role_colon": ROLE_COLON_CHAT_TEMPLATE}
"""The chat templates ``train_tokenizer`` can give its tokenizer, by name."""

_SPECIAL_TOKEN_PATTERN = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


def train_tokenizer(
    corpus: Iterable[str], *, vocab_size: int = 512, chat_template: str = "chatml"
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus` and wrap it for `transformers`, with the chat template named
    `chat_template` (``CHAT_TEMPLATES``: ChatML, or ``role_colon``'s "User: ...").

    `vocab_size` is an upper bound that includes the 256 byte tokens and the special tokens: a small corpus runs out of
    pairs to merge earlier, so use `len(tokenizer)` as the model's vocabulary size. Same corpus, same tokenizer.
    """
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {chat_template!r}; allowed: {', '.join(CHAT_TEMPLATES)}")
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small: the byte alphabet and special tokens need {minimum}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Training does not match special tokens in the text, so rendered chat markers would be split into bytes and spend
    # merges on "<|", "im_" and the like; cut them out first.
    pieces = (piece for text in corpus for piece in _SPECIAL_TOKEN_PATTERN.split(text) if piece)
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=IM_END_TOKEN,
        unk_token=ENDOFTEXT_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATES[chat_template]
    return wrapped
