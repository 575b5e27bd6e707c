"""Tests for the locally trained byte-level BPE tokenizer and its ChatML template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from spmd_rlhf.tiny.task import task_corpus
from spmd_rlhf.tiny.tokenizer import train_tokenizer

CORPUS = task_corpus("arithmetic") + [
    "The quick brown fox jumps over the lazy dog.",
    "Numbers like 2024 and 31415 appear in text, too.",
]
TEXTS = [
    "3+4=",
    "12345 + 67890 = 80235",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\tindented after a blank line\r\n",
    "Unicode: héllo wörld, 数字 ४२, emoji 🙂",
    "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=512)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode_exactly(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_single_tokens_and_never_merge(tokenizer):
    ids = tokenizer.encode("x 12345+67890=80235\n")
    pieces = [tokenizer.decode([token_id]) for token_id in ids]
    assert [piece for piece in pieces if any(c.isdigit() for c in piece)] == list("123456789080235")
    # No learned merge contains a digit: every vocabulary entry with a digit is that digit alone.
    for token in tokenizer.get_vocab():
        if any(c.isdigit() for c in token):
            assert len(token) == 1, token


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.bos_token == "<|bos|>"
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    # Special tokens in text are single ids; nothing is added around plain text.
    assert tokenizer.encode("<|im_start|>") == [tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    assert tokenizer.encode("") == []


def test_vocab_size_is_an_upper_bound(tokenizer):
    assert len(tokenizer) <= 512
    assert len(train_tokenizer(CORPUS, vocab_size=300)) == 300
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(CORPUS, vocab_size=100)


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == without_prompt + "<|im_start|>assistant\n"
    ids = tokenizer.encode(text)
    generation_prompt_ids = tokenizer.encode("<|im_start|>assistant\n")
    assert ids[-len(generation_prompt_ids) :] == generation_prompt_ids


def test_assistant_turn_ends_with_eos(tokenizer):
    messages = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False))
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    assert ids[: len(prompt_ids)] == prompt_ids
    assert tokenizer.decode(ids[len(prompt_ids) :]) == "7<|im_end|>\n"
    assert ids[len(prompt_ids) + 1] == tokenizer.eos_token_id


def test_save_and_auto_tokenizer_load_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tokenizer)
    assert loaded.chat_template == tokenizer.chat_template
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(loaded, name) == getattr(tokenizer, name)
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.decode(loaded.encode(text)) == text


def test_same_corpus_gives_same_tokenizer(tokenizer):
    again = train_tokenizer(CORPUS, vocab_size=512)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert again.chat_template == tokenizer.chat_template


def test_the_role_colon_template_lays_a_chat_out_without_markers():
    tokenizer = train_tokenizer(CORPUS, vocab_size=512, chat_template="role_colon")
    messages = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "User: 3+4=\n\nAssistant: 7\n\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "User: 3+4=\n\nAssistant:"
    with pytest.raises(ValueError, match=r"unknown chat template 'alpaca'; allowed: chatml, role_colon"):
        train_tokenizer(CORPUS, chat_template="alpaca")
