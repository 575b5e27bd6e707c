"""Synthetic prompt datasets in verl's row schema, small enough for a tiny random-init model to learn with RL on CPU.

    spmd-rlhf make-task --task arithmetic --out tiny/task

Each row is what verl's RL datasets hold, so the same loader serves these files and users' own:

    {"data_source": "synthetic/arithmetic",
     "prompt": [{"role": "user", "content": "3+4="}],
     "ability": "arithmetic",
     "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"split": "train", "index": 0, "a": 3, "b": 4}}

Task "tool_products" is products of two-digit numbers, which the tiny model cannot compute but the sandboxed
calculator can: multi-turn rollouts with ``rollout.environment=tool`` (docs/multiturn.md). Its rows list the calculator
in ``extra_info.tools`` (an OpenAI tool schema, which the chat template lays out where the model's family expects):

    {"data_source": "synthetic/tool_products",
     "prompt": [{"role": "user", "content": "37*58="}],
     "reward_model": {"style": "rule", "ground_truth": "2146"},
     "extra_info": {"split": "train", "index": 0, "a": 37, "b": 58, "tools": [{"type": "function", ...}]}}

Task "arithmetic" is single-digit addition: 100 distinct prompts of four tokens each, answers 0-18 of one or two digit
tokens followed by eos. A policy only has to map (a, b) to at most two tokens, and `score_arithmetic` gives partial
credit for any integer, so even a random-init model sees non-zero rewards from the first step and reward rises quickly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TASKS = ("arithmetic", "tool_products")


_ARITHMETIC_PAIRS = [(a, b) for a in range(10) for b in range(10)]
_PRODUCT_PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed tasks: {', '.join(TASKS)}")


def _arithmetic_row(a: int, b: int, *, split: str, index: int) -> dict:
    return {
        "data_source": "synthetic/arithmetic",
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def _tool_products_row(a: int, b: int, *, split: str, index: int) -> dict:
    from spmd_rlhf.envs.sandbox import sandboxed_tool

    return {
        "data_source": "synthetic/tool_products",
        "prompt": [{"role": "user", "content": f"{a}*{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {
            "split": split,
            "index": index,
            "a": a,
            "b": b,
            "tools": [sandboxed_tool("calculator").schema()],
        },
    }


_ROWS = {"arithmetic": (_ARITHMETIC_PAIRS, _arithmetic_row), "tool_products": (_PRODUCT_PAIRS, _tool_products_row)}


def make_rows(*, task: str, train_size: int, val_size: int, seed: int) -> dict[str, list[dict]]:
    """Rows of the train and val splits, drawn with a generator seeded by `seed` alone.

    Both splits are drawn uniformly with replacement from all of a task's prompts (the arithmetic task has only 100,
    fewer than a useful train split), so val is not disjoint from train: it measures how well the policy learned the
    task, not generalisation to unseen prompts.
    """
    _check_task(task)
    for name, size in (("train_size", train_size), ("val_size", val_size)):
        if size < 1:
            raise ValueError(f"{name}={size}: each split needs at least one row")
    rng = random.Random(seed)
    all_pairs, make_row = _ROWS[task]
    rows: dict[str, list[dict]] = {}
    for split, size in (("train", train_size), ("val", val_size)):
        pairs = [rng.choice(all_pairs) for _ in range(size)]
        rows[split] = [make_row(a, b, split=split, index=index) for index, (a, b) in enumerate(pairs)]
    return rows


def make_task(*, task: str, out_dir: str, train_size: int = 2048, val_size: int = 256, seed: int = 0) -> list[str]:
    """Write `train.parquet`, `val.parquet`, `train.jsonl` and `val.jsonl` under `out_dir`; return their paths.

    Parquet keeps the nested columns as Arrow lists and structs, so `prompt` reads back as a list of message dicts
    (pyarrow `to_pylist`) exactly as verl's loader expects; the JSONL files hold the same rows for reading by eye.
    """
    rows = make_rows(task=task, train_size=train_size, val_size=val_size, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, split_rows in rows.items():
        parquet_path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(split_rows), parquet_path)
        jsonl_path = out / f"{split}.jsonl"
        jsonl_path.write_text("".join(json.dumps(row) + "\n" for row in split_rows))
        paths += [str(parquet_path), str(jsonl_path)]
    return paths


def task_corpus(task: str) -> list[str]:
    """Text for training a tokenizer that covers `task`: every prompt and answer as a chat turn.

    Each turn is the text the ChatML template puts between `<|im_start|>` and `<|im_end|>` ("user\\n3+4=",
    "assistant\\n7"), plus the newline the template puts between turns. The tool_products corpus holds a calculator
    call, its tool message and the restated product for a sample of its prompts (digits never merge, so the words and
    punctuation of a call are what the tokenizer learns from it).
    """
    _check_task(task)
    corpus = ["\n"]
    if task == "arithmetic":
        for a, b in _ARITHMETIC_PAIRS:
            corpus += [f"user\n{a}+{b}=", f"assistant\n{a + b}"]
        return corpus
    for a, b in random.Random(0).sample(_PRODUCT_PAIRS, 64):
        corpus += [f"user\n{a}*{b}=", f"assistant\n{_calculator_call(a, b)}", f"tool\n{a * b}", f"assistant\n{a * b}"]
    return corpus


def _calculator_call(a: int, b: int) -> str:
    from spmd_rlhf.envs.tools import format_tool_call

    return format_tool_call("calculator", {"expression": f"{a}*{b}"})


TOOL_DEMONSTRATION_KINDS = ("call", "broken_call", "guess")


def tool_products_demonstration(row: dict, *, kind: str, guess: int) -> list[str]:
    """The assistant's turns of one demonstration for a tool_products `row`, as a supervised warm start teaches them:

    - "call": a calculator call on the row's numbers, then the product restated (what the calculator answers);
    - "broken_call": the same call with the expression not quoted (not JSON: the environment answers with an error),
      then `guess`;
    - "guess": `guess` straight away, no tool.

    A policy warm-started on a mix of the three makes calls that succeed only some of the time, which RL can improve.
    """
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    if kind == "call":
        return [_calculator_call(a, b), str(a * b)]
    if kind == "broken_call":
        return [_calculator_call(a, b).replace(f'"{a}*{b}"', f"{a}*{b}"), str(guess)]
    if kind == "guess":
        return [str(guess)]
    raise ValueError(f"unknown demonstration kind {kind!r}; allowed kinds: {', '.join(TOOL_DEMONSTRATION_KINDS)}")
