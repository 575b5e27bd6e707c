"""Prompt datasets in verl's row schema (parquet or JSONL) and the step-indexed loader that batches them.

A row holds ``prompt`` (chat messages, or plain text), ``data_source``, ``reward_model.ground_truth`` and
``extra_info``, so users' existing verl files load as they are. Prompts are rendered with the tokenizer's chat template
and tokenized once, up front: an over-long prompt or a missing field fails (or is skipped and counted) at start, not
mid-run.

The loader is a pure function of the step number: step s takes positions ``s*B .. s*B+B-1`` of an endless stream that
visits the dataset once per epoch in an order drawn from ``seed + epoch``. Resuming needs nothing but the step, and
every prompt gets a run-unique ``uid`` (its stream position) from which the actor derives per-sample seeds, so sampling
does not depend on how the batch is split over ranks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spmd_rlhf.data.batch import Batch


class DatasetError(ValueError):
    """A prompt file or row that cannot be used, named with the file and row."""


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of one parquet (``.parquet``) or JSON-lines (``.jsonl`` / ``.json``) file; a ``.json`` file may also hold
    one JSON array of rows."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"prompt file {path} does not exist; check data.train_files / data.val_files")
    if file.suffix == ".parquet":
        # Imported here: pyarrow's allocator starts a thread at import, in every rank that only reads JSON lines.
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    if file.suffix == ".json" and file.read_text(encoding="utf-8").lstrip().startswith("["):
        try:
            rows = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path} is not valid JSON: {error}") from None
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DatasetError(f"{path} row {index} is a {type(row).__name__}, not an object of fields")
        return rows
    if file.suffix in (".jsonl", ".json"):
        rows = []
        for line_number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise DatasetError(f"{path}:{line_number} is not valid JSON: {error}") from None
        return rows
    raise DatasetError(f"prompt file {path}: unknown format {file.suffix!r}; use .parquet or .jsonl")


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]
    raw_prompt: str | list[dict[str, Any]] | None = None
    """The row's prompt, ``normalize_prompt``-ed: where a multi-turn environment starts from."""


class PromptDataset:
    """Every usable prompt of ``files``, tokenized; ``num_skipped`` counts over-long prompts dropped with ``skip``,
    ``num_truncated`` those cut to their last ``max_prompt_length`` tokens with ``truncate`` (the end of a prompt,
    with the chat template's opened assistant turn, is what the response continues)."""

    def __init__(
        self,
        files: list[str],
        tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int,
        overlong_prompts: str = "error",
    ) -> None:
        self.prompts: list[Prompt] = []
        self.num_skipped = self.num_truncated = 0
        for path in files:
            for index, row in enumerate(read_rows(path)):
                where = f"{path} row {index}"
                if prompt_key not in row:
                    raise DatasetError(f"{where} has no {prompt_key!r} field (data.prompt_key); fields: {sorted(row)}")
                extra_info = row.get("extra_info") or {}
                prompt = normalize_prompt(row[prompt_key], where=where)
                token_ids = encode_prompt(tokenizer, prompt, where=where, tools=extra_info.get("tools"))
                if len(token_ids) > max_prompt_length:
                    if overlong_prompts == "skip":
                        self.num_skipped += 1
                        continue
                    if overlong_prompts == "truncate":
                        self.num_truncated += 1
                        token_ids = token_ids[-max_prompt_length:]
                    else:
                        raise DatasetError(
                            f"{where} has {len(token_ids)} prompt tokens, over data.max_prompt_length="
                            f"{max_prompt_length}; raise it or set data.overlong_prompts=skip or truncate"
                        )
                reward_model = _reward_model(row.get("reward_model"), where=where)
                self.prompts.append(
                    Prompt(
                        token_ids, str(row.get("data_source", "")), reward_model.get("ground_truth"), extra_info, prompt
                    )
                )
        if not self.prompts:
            why = (
                f"all {self.num_skipped} are over data.max_prompt_length={max_prompt_length} tokens and were skipped; "
                f"raise it or set data.overlong_prompts=truncate"
                if self.num_skipped
                else "the files hold no rows; check data.train_files / data.val_files"
            )
            raise DatasetError(f"no usable prompts in {files}: {why}")

    def __len__(self) -> int:
        return len(self.prompts)


def _reward_model(value: Any, *, where: str) -> dict[str, Any]:
    """A row's ``reward_model`` field as a dict: missing is empty, and a string holding a JSON object (a column some
    exporters write as text) is parsed."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise DatasetError(
            f'{where}: reward_model is {value!r:.60}; it must be an object such as {{"ground_truth": "42"}} (or '
            f"a string holding one as JSON)"
        )
    return value


def normalize_prompt(prompt: Any, *, where: str) -> str | list[dict[str, Any]]:
    """A row's prompt as non-empty text, or as chat messages whose contents are text (a content given as a list of
    text parts, ``[{"type": "text", "text": ...}]``, is joined)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: the prompt is empty; give it text or remove the row")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
    ):
        return [{**message, "content": _message_text(message["content"], where=where)} for message in prompt]
    raise DatasetError(f"{where}: a prompt must be text or a list of {{role, content}} messages, got {prompt!r:.100}")


def encode_prompt(tokenizer, prompt: str | list[dict[str, Any]], *, where: str, tools: list | None = None) -> list[int]:
    """Token ids of a ``normalize_prompt``-ed prompt: chat messages rendered with the chat template and the assistant
    turn opened, or plain text. ``tools``: the row's ``extra_info.tools``; its OpenAI schemas go to the chat template,
    which lays them out as the model's family expects (tool names alone are left to the prompt's text)."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"{where}: the prompt is chat messages but the tokenizer ({tokenizer.name_or_path}) has no chat "
            f"template; point model.tokenizer_path at a tokenizer with one (an instruct model's), or give prompts "
            f"as plain text"
        )
    text = tokenizer.apply_chat_template(
        prompt, tools=template_tools(tools), add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def template_tools(tools: list | None) -> list[dict[str, Any]] | None:
    """What the chat template gets of a row's ``extra_info.tools``: its OpenAI schemas (tool names alone are left to
    the prompt's text), or None when it has none. The prompt and a multi-turn rollout's observation deltas are
    rendered with the same."""
    schemas = [tool for tool in tools or [] if isinstance(tool, dict)]
    return schemas or None


def _message_text(content: Any, *, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise DatasetError(
        f"{where}: a message's content must be text or a list of {{type: text, text}} parts (images and other "
        f"parts are not supported), got {content!r:.100}"
    )


class PromptLoader:
    """Batches of ``batch_size`` prompts per step, left-padded to the batch's longest prompt."""

    def __init__(
        self, dataset: PromptDataset, *, batch_size: int, pad_token_id: int, shuffle: bool = True, seed: int = 0
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.shuffle = shuffle
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._orders = {epoch: torch.randperm(len(self.dataset), generator=generator).tolist()}
            else:
                self._orders = {epoch: list(range(len(self.dataset)))}
        return self._orders[epoch]

    def batch(self, step: int) -> Batch:
        """The prompts of training step ``step`` (0-based)."""
        size = len(self.dataset)
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        prompts = [self.dataset.prompts[self._order(position // size)[position % size]] for position in positions]
        width = max(len(prompt.token_ids) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt.token_ids) :] = torch.tensor(prompt.token_ids)
            attention_mask[row, width - len(prompt.token_ids) :] = 1
        return Batch(
            {"input_ids": input_ids, "attention_mask": attention_mask, "uid": torch.tensor(list(positions))},
            {
                "data_source": [prompt.data_source for prompt in prompts],
                "ground_truth": [prompt.ground_truth for prompt in prompts],
                "extra_info": [prompt.extra_info for prompt in prompts],
                "raw_prompt": [prompt.raw_prompt for prompt in prompts],
            },
            {"step": step},
        )
