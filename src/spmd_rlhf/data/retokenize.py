"""A scoring model with a tokenizer of its own (a reward model of another family, e.g. Skywork-Reward on Llama 3.1
for a Qwen policy): the rollout's responses as text, and each conversation rebuilt in that model's chat template and
tokens.

The policy's token ids mean other tokens to a model of another vocabulary, and a model trained on its own chat layout
misreads another one. ``foreign_tokenizer`` decides, once per role, whether a scoring model reads the policy's ids as
they are (its tokenizer has the policy's vocabulary and chat template, or it has none of its own) or text, through
its own tokenizer; ``ChatRebuild`` then turns each rollout batch into the scorer's own rows:

    response text  the policy tokenizer's decoding of the response tokens (``response_mask``), special tokens
                   (EOS, padding) dropped: what a rule reward reads too
    conversation   the row's prompt messages (``raw_prompt``; a plain-text prompt becomes one user message), then
                   the response text as the assistant's message
    scorer ids     the scorer's chat template rendered over the conversation and tokenized with no special tokens
                   added, as ``transformers``' ``apply_chat_template(..., tokenize=True)`` does

The score head reads each rebuilt row's last token; the one score per response it gives then sits on the policy's
last response token, as every sequence score does (``algos.advantages.scores_to_token_rewards``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spmd_rlhf.config import ScoringRoleConfig
from spmd_rlhf.data.batch import Batch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""A model directory holding any of these has a tokenizer of its own."""


def has_tokenizer(directory: str) -> bool:
    return any(Path(directory, file).is_file() for file in TOKENIZER_FILES)


def scorer_tokenizer_path(role_config: ScoringRoleConfig) -> str | None:
    """The tokenizer directory a scoring model reads with: ``tokenizer_path``, else ``model_path`` when it holds
    tokenizer files; None when it has none of its own (it then reads the policy's token ids)."""
    if role_config.tokenizer_path is not None:
        return role_config.tokenizer_path
    if role_config.model_path is not None and has_tokenizer(role_config.model_path):
        return role_config.model_path
    return None


def foreign_tokenizer(role_config: ScoringRoleConfig, policy_tokenizer) -> Any | None:
    """The scoring model's own tokenizer when its vocabulary or chat template differs from ``policy_tokenizer``'s
    (the model then scores rebuilt text: ``ChatRebuild``); None when the model reads the policy's token ids as they
    are (no tokenizer of its own, or one with the same vocabulary and chat template)."""
    from transformers import AutoTokenizer

    path = scorer_tokenizer_path(role_config)
    if path is None:
        return None
    tokenizer = AutoTokenizer.from_pretrained(path)
    same_vocabulary = tokenizer.get_vocab() == policy_tokenizer.get_vocab()
    if same_vocabulary and tokenizer.chat_template == policy_tokenizer.chat_template:
        return None
    return tokenizer


def judge_tokenizer(role_config: ScoringRoleConfig, policy_tokenizer, *, role: str) -> Any:
    """A generative judge's tokenizer: its own (``scorer_tokenizer_path``), else the policy's. A judge is given its
    prompt as a conversation in this tokenizer's chat template, so one without a template is refused."""
    from transformers import AutoTokenizer

    path = scorer_tokenizer_path(role_config)
    tokenizer = policy_tokenizer if path is None else AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{role}: the judge's tokenizer ({tokenizer.name_or_path}) has no chat template, so its prompt cannot be "
            f"laid out as the conversation it was tuned on; point {role}.tokenizer_path at a tokenizer with one (an "
            f"instruction-tuned model's)"
        )
    return tokenizer


def response_texts(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Each row's response tokens (where ``response_mask`` is set) decoded without special tokens."""
    return tokenizer.batch_decode(
        [row[mask.bool()].tolist() for row, mask in zip(responses, response_mask)], skip_special_tokens=True
    )


class ChatRebuild:
    """Rollout rows in the policy's tokens -> the same conversations in a scoring model's own chat template and
    tokens (the module docstring), for the role named ``role`` (named in errors)."""

    def __init__(self, policy_tokenizer, scorer_tokenizer, *, role: str) -> None:
        if not getattr(scorer_tokenizer, "chat_template", None):
            raise ValueError(
                f"{role}: the scoring model's tokenizer ({scorer_tokenizer.name_or_path}) differs from the policy's "
                f"and has no chat template, so the conversations cannot be rebuilt for it; point {role}.tokenizer_path "
                f"at the tokenizer it was trained with (one with a chat template)"
            )
        self.policy_tokenizer = policy_tokenizer
        self.scorer_tokenizer = scorer_tokenizer
        self.role = role

    def conversations(self, batch: Batch) -> list[list[dict[str, Any]]]:
        """Each row's prompt messages followed by its response as the assistant's message."""
        if "raw_prompt" not in batch.non_tensors:
            raise ValueError(
                f"{self.role}: the batch has no raw_prompt field (the dataset row's prompt), which a scoring model "
                f"with its own tokenizer needs to rebuild the conversation; batches from PromptLoader carry it"
            )
        texts = response_texts(self.policy_tokenizer, batch["responses"], batch["response_mask"])
        conversations = []
        for prompt, text in zip(batch["raw_prompt"], texts):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            conversations.append([*messages, {"role": "assistant", "content": text}])
        return conversations

    def __call__(self, batch: Batch) -> Batch:
        """``batch``'s rows as the scorer's rollout layout: each whole rebuilt conversation is the row's prompt
        (left-padded ``prompts`` = ``input_ids``, ``attention_mask``), with an empty response (``responses`` and
        ``response_mask`` ``[rows, 0]``): a score head reads the last attended token and nothing else."""
        rendered = self.scorer_tokenizer.apply_chat_template(self.conversations(batch), tokenize=False)
        token_ids = self.scorer_tokenizer(rendered, add_special_tokens=False)["input_ids"]
        width = max(len(ids) for ids in token_ids)
        pad_id = self.scorer_tokenizer.pad_token_id or 0
        input_ids = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(token_ids), width), dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        empty = torch.zeros((len(token_ids), 0), dtype=torch.long)
        tensors = {
            "prompts": input_ids,
            "responses": empty,
            "response_mask": empty,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
        }
        return Batch(tensors, group_size=batch.group_size)
