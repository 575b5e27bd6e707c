"""Tests for the synthetic prompt datasets (verl row schema) and the arithmetic rule reward."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from spmd_rlhf.rewards.synthetic import score_arithmetic
from spmd_rlhf.tiny.task import make_rows, make_task, task_corpus


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_make_task_writes_parquet_and_jsonl_with_equal_rows(tmp_path):
    paths = make_task(task="arithmetic", out_dir=str(tmp_path / "task"), train_size=64, val_size=16, seed=3)
    names = sorted(Path(path).name for path in paths)
    assert names == ["train.jsonl", "train.parquet", "val.jsonl", "val.parquet"]
    for split, size in (("train", 64), ("val", 16)):
        parquet_rows = pq.read_table(tmp_path / "task" / f"{split}.parquet").to_pylist()
        jsonl_rows = _read_jsonl(tmp_path / "task" / f"{split}.jsonl")
        assert parquet_rows == jsonl_rows
        assert parquet_rows == make_rows(task="arithmetic", train_size=64, val_size=16, seed=3)[split]
        assert len(parquet_rows) == size


def test_rows_follow_verl_schema_with_correct_answers():
    rows = make_rows(task="arithmetic", train_size=200, val_size=20, seed=0)
    for split, split_rows in rows.items():
        for index, row in enumerate(split_rows):
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert row["data_source"] == "synthetic/arithmetic"
            assert row["ability"] == "arithmetic"
            a, b = row["extra_info"]["a"], row["extra_info"]["b"]
            assert 0 <= a <= 9 and 0 <= b <= 9
            assert row["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
            assert row["extra_info"]["split"] == split
            assert row["extra_info"]["index"] == index
    # 200 uniform draws from 100 prompts hit many distinct ones: the split is not one repeated row.
    assert len({row["prompt"][0]["content"] for row in rows["train"]}) > 50


def test_pandas_reads_nested_prompt_as_message_dicts(tmp_path):
    make_task(task="arithmetic", out_dir=str(tmp_path), train_size=8, val_size=4)
    frame = pd.read_parquet(tmp_path / "train.parquet")
    first = frame.iloc[0]
    messages = list(first["prompt"])
    assert messages == [{"role": "user", "content": messages[0]["content"]}]
    assert first["reward_model"]["ground_truth"] == str(first["extra_info"]["a"] + first["extra_info"]["b"])


def test_rows_are_seeded_and_deterministic():
    first = make_rows(task="arithmetic", train_size=32, val_size=8, seed=7)
    assert make_rows(task="arithmetic", train_size=32, val_size=8, seed=7) == first
    assert make_rows(task="arithmetic", train_size=32, val_size=8, seed=8) != first


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="allowed tasks: arithmetic"):
        make_task(task="gsm8k", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="allowed tasks: arithmetic"):
        task_corpus("gsm8k")
    with pytest.raises(ValueError, match="val_size=0"):
        make_task(task="arithmetic", out_dir=str(tmp_path), val_size=0)


def test_task_corpus_holds_every_prompt_and_answer_as_chat_turns():
    corpus = set(task_corpus("arithmetic"))
    for a in range(10):
        for b in range(10):
            assert f"user\n{a}+{b}=" in corpus
    assert {f"assistant\n{total}" for total in range(19)} <= corpus


@pytest.mark.parametrize(
    ("response", "ground_truth", "reward"),
    [
        ("7", "7", 1.0),
        (" 7\n", "7", 1.0),
        ("7 is the answer", "7", 1.0),
        ("the answer: 12", "12", 1.0),
        ("07", "7", 1.0),
        ("8", "7", 0.1),
        ("-7", "7", 0.1),
        ("8 or 7", "7", 0.1),
        ("1", "12", 0.1),
        ("", "7", 0.0),
        ("seven", "7", 0.0),
        ("+=", "7", 0.0),
    ],
)
def test_score_arithmetic(response, ground_truth, reward):
    assert score_arithmetic(response, ground_truth) == reward


def test_tool_products_rows_list_the_calculator_and_score_the_final_answer():
    from spmd_rlhf.rewards import RULES
    from spmd_rlhf.rewards.synthetic import score_tool_product

    rows = make_rows(task="tool_products", train_size=4, val_size=2, seed=0)
    row = rows["train"][0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert 10 <= a < 100 and 10 <= b < 100 and row["reward_model"]["ground_truth"] == str(a * b)
    assert row["extra_info"]["tools"][0]["function"]["name"] == "calculator"
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}</tool_call>'
    assert score_tool_product(f"{call}{a * b}", str(a * b)) == 1.0
    assert score_tool_product(call, str(a * b)) == 0.0  # the operands inside the call are no answer
    assert score_tool_product(f"{call}{a * b + 1}", str(a * b)) == 0.1
    assert RULES["synthetic/tool_products"]("synthetic/tool_products", f"{a * b}", str(a * b)) == 1.0


def test_tool_products_corpus_and_demonstrations():
    from spmd_rlhf.envs import parse_tool_calls
    from spmd_rlhf.tiny.task import tool_products_demonstration

    corpus = task_corpus("tool_products")
    assert any(text.startswith("assistant\n<tool_call>") for text in corpus) and "\n" in corpus
    row = make_rows(task="tool_products", train_size=1, val_size=1, seed=0)["train"][0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    call, answer = tool_products_demonstration(row, kind="call", guess=123)
    assert parse_tool_calls(call)[0].arguments == {"expression": f"{a}*{b}"} and answer == str(a * b)
    broken, guess = tool_products_demonstration(row, kind="broken_call", guess=123)
    assert parse_tool_calls(broken)[0].error.startswith("the tool call is not valid JSON") and guess == "123"
    assert tool_products_demonstration(row, kind="guess", guess=123) == ["123"]
    with pytest.raises(ValueError, match="allowed kinds: call, broken_call, guess"):
        tool_products_demonstration(row, kind="other", guess=123)
