"""The supervised warm start: demonstrations laid out token for token as a multi-turn rollout lays them out, the loss
on the assistant's tokens only, and a fit that lowers the loss and writes a loadable model."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rlhf.data.dataset import encode_prompt
from spmd_rlhf.envs import ChatDelta, Tool, ToolEnvironment
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.tiny.task import make_rows, tool_products_demonstration
from spmd_rlhf.tiny.warm_start import demonstration_tokens, warm_start


def product_tool() -> dict[str, Tool]:
    def calculator(expression: str) -> str:
        a, b = expression.split("*")
        return str(int(a) * int(b))

    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    return {"calculator": Tool("calculator", "a*b", schema, calculator)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny(
        family="llama",
        out_dir=str(tmp_path_factory.mktemp("model")),
        hidden_size=32,
        num_layers=1,
        tokenizer_tasks=("arithmetic", "tool_products"),
    )


def test_demonstration_tokens_mask_exactly_the_assistant_turns(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    delta = ChatDelta(tokenizer)
    row = make_rows(task="tool_products", train_size=1, val_size=1, seed=0)["train"][0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    call, answer = tool_products_demonstration(row, kind="call", guess=0)
    ids, mask = demonstration_tokens(tokenizer, delta, row, [call, answer], ToolEnvironment(product_tool()))

    prompt = encode_prompt(tokenizer, row["prompt"], where="test")
    call_ids = tokenizer.encode(call) + [delta.turn_end_id]
    observation = delta.observation_ids([{"role": "tool", "content": str(a * b)}])
    answer_ids = tokenizer.encode(answer) + [delta.turn_end_id]
    assert ids == prompt + call_ids + observation + answer_ids
    assert mask == [0] * len(prompt) + [1] * len(call_ids) + [0] * len(observation) + [1] * len(answer_ids)

    with pytest.raises(ValueError, match="did not end the conversation after turn 0 of a 1-turn"):
        demonstration_tokens(tokenizer, delta, row, [call], ToolEnvironment(product_tool()))
    with pytest.raises(ValueError, match="ended the conversation after turn 0 of a 2-turn"):
        demonstration_tokens(tokenizer, delta, row, [answer, answer], ToolEnvironment(product_tool()))


def test_warm_start_lowers_the_loss_and_saves_in_place(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    delta, environment = ChatDelta(tokenizer), ToolEnvironment(product_tool())
    rows = make_rows(task="tool_products", train_size=8, val_size=1, seed=0)["train"]
    demonstrations = [
        demonstration_tokens(tokenizer, delta, row, tool_products_demonstration(row, kind="call", guess=0), environment)
        for row in rows
    ]
    before = AutoModelForCausalLM.from_pretrained(tiny).model.embed_tokens.weight.clone()
    losses = warm_start(tiny, demonstrations, steps=30, batch_size=4, lr=1e-2)
    assert len(losses) == 30 and max(losses[-5:]) < 0.6 * losses[0]
    assert not AutoModelForCausalLM.from_pretrained(tiny).model.embed_tokens.weight.equal(before)


def test_micro_batches_of_rows_sorted_by_length_give_the_whole_batchs_mean(tiny, tmp_path):
    """The same steps in one micro-batch and in micro-batches of one row (each its own width): the same losses and
    weights, since every micro-batch's loss is summed over the whole batch's masked tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    delta, environment = ChatDelta(tokenizer), ToolEnvironment(product_tool())
    rows = make_rows(task="tool_products", train_size=6, val_size=1, seed=0)["train"]
    demonstrations = [  # a guess is one short turn, a call two turns and the tool's answer: rows of unequal length
        demonstration_tokens(tokenizer, delta, row, tool_products_demonstration(row, kind=kind, guess=7), environment)
        for row, kind in zip(rows, ["call", "guess"] * 3)
    ]
    fits = {}
    for micro_batch_size in (4, 1):
        model_dir = tmp_path / str(micro_batch_size)
        shutil.copytree(tiny, model_dir)
        losses = warm_start(str(model_dir), demonstrations, steps=3, batch_size=4, micro_batch_size=micro_batch_size)
        fits[micro_batch_size] = losses, AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    (whole, whole_weights), (split, split_weights) = fits[4], fits[1]
    assert split == pytest.approx(whole, rel=1e-5)
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
