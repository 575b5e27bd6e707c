"""Tests for prompt datasets in verl's schema and the step-indexed prompt loader."""

from __future__ import annotations

import json

import pytest
import torch

from spmd_rlhf.data.dataset import DatasetError, PromptDataset, PromptLoader
from spmd_rlhf.tiny.task import make_task, task_corpus
from spmd_rlhf.tiny.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(task_corpus("arithmetic"))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("task")
    make_task(task="arithmetic", out_dir=str(out), train_size=20, val_size=4, seed=1)
    return out


def test_parquet_and_jsonl_give_the_same_prompts_rendered_with_the_chat_template(tokenizer, task_dir):
    parquet = PromptDataset([str(task_dir / "train.parquet")], tokenizer, max_prompt_length=64)
    jsonl = PromptDataset([str(task_dir / "train.jsonl")], tokenizer, max_prompt_length=64)
    assert parquet.prompts == jsonl.prompts and len(parquet) == 20
    first = json.loads((task_dir / "train.jsonl").read_text().splitlines()[0])
    text = tokenizer.decode(parquet.prompts[0].token_ids)
    assert text == f"<|im_start|>user\n{first['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert parquet.prompts[0].ground_truth == first["reward_model"]["ground_truth"]
    assert parquet.prompts[0].data_source == "synthetic/arithmetic"


def test_overlong_prompts_fail_naming_the_row_or_are_skipped_and_counted(tokenizer, tmp_path):
    rows = [{"prompt": "1+1=", "data_source": "x"}, {"prompt": "1+1=" * 30, "data_source": "x"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DatasetError, match=r"rows.jsonl row 1 has \d+ prompt tokens, over data.max_prompt_length=16"):
        PromptDataset([str(path)], tokenizer, max_prompt_length=16)
    dataset = PromptDataset([str(path)], tokenizer, max_prompt_length=16, overlong_prompts="skip")
    assert len(dataset) == 1 and dataset.num_skipped == 1
    dataset = PromptDataset([str(path)], tokenizer, max_prompt_length=16, overlong_prompts="truncate")
    assert len(dataset) == 2 and dataset.num_truncated == 1 and dataset.num_skipped == 0
    full = PromptDataset([str(path)], tokenizer, max_prompt_length=1000).prompts[1].token_ids
    assert dataset.prompts[1].token_ids == full[-16:]  # the end of the prompt is kept


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no usable prompts"),
        ('{"text": "hi"}\n', "has no 'prompt' field"),
        ("{bad\n", r"rows.jsonl:1 is not valid JSON"),
    ],
)
def test_bad_files_are_clear_errors(tokenizer, tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        PromptDataset([str(path)], tokenizer, max_prompt_length=16)
    with pytest.raises(DatasetError, match="does not exist"):
        PromptDataset([str(tmp_path / "missing.parquet")], tokenizer, max_prompt_length=16)


def test_loader_is_a_pure_function_of_the_step_visiting_every_prompt_once_per_epoch(tokenizer, task_dir):
    dataset = PromptDataset([str(task_dir / "train.parquet")], tokenizer, max_prompt_length=64)
    loader = PromptLoader(dataset, batch_size=8, pad_token_id=tokenizer.pad_token_id, seed=3)
    batches = [loader.batch(step) for step in range(5)]  # 40 positions = 2 epochs of 20
    uids = torch.cat([batch["uid"] for batch in batches])
    assert uids.tolist() == list(range(40))
    fresh = PromptLoader(dataset, batch_size=8, pad_token_id=tokenizer.pad_token_id, seed=3)
    assert torch.equal(fresh.batch(3)["input_ids"], batches[3]["input_ids"])  # resume needs only the step
    epoch = [
        tuple(ids[mask.bool()].tolist())
        for batch in batches
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
    ]
    assert sorted(epoch[:20]) == sorted(tuple(p.token_ids) for p in dataset.prompts)
    assert epoch[:20] != epoch[20:]  # reshuffled per epoch
    batch = batches[0]
    assert batch["input_ids"].shape[0] == 8 and batch.meta == {"step": 0}
    assert bool((batch["attention_mask"][:, -1] == 1).all())  # left padding
    assert set(batch.non_tensors) == {"data_source", "ground_truth", "extra_info", "raw_prompt"}
