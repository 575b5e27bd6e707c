"""A supervised warm start for tiny models: teach a format a random-init policy never writes (a tool call) from
demonstrations, so an RL test can start from a policy that uses it some of the time.

    turns = tool_products_demonstration(row, kind="call", guess=0)
    ids, mask = demonstration_tokens(tokenizer, ChatDelta(tokenizer), row, turns, ToolEnvironment())
    warm_start(model_dir, [(ids, mask), ...], steps=300)

    make_tool_products_policy("tiny/tool_policy")     # all of it for the tool task: model, demonstrations, fit

A demonstration is a dataset row and the assistant's turns as text. ``demonstration_tokens`` lays it out token for
token as a multi-turn rollout would (``envs.multi_turn``): the prompt as the dataset encodes it, each turn's tokens and
the template's end of turn, then the environment's real answer as the chat template's delta; the loss mask covers the
assistant's tokens only. ``warm_start`` fits the model on them with ``transformers`` and writes it back in place.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spmd_rlhf.data.dataset import encode_prompt, normalize_prompt
from spmd_rlhf.envs.base import Environment
from spmd_rlhf.envs.chat_delta import ChatDelta, template_context
from spmd_rlhf.envs.tool_env import ToolEnvironment
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.tiny.task import TOOL_DEMONSTRATION_KINDS, make_rows, tool_products_demonstration


def demonstration_tokens(
    tokenizer, delta: ChatDelta, row: dict[str, Any], turns: list[str], environment: Environment
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of ``row``'s prompt followed by ``turns``, each answered by ``environment`` (fresh);
    the mask is 1 on the assistant's tokens, end-of-turn tokens included. Raises ``ValueError`` when the environment
    ends the conversation before the last turn or goes on after it."""
    prompt = normalize_prompt(row["prompt"], where="demonstration")
    tools = (row.get("extra_info") or {}).get("tools")
    token_ids = encode_prompt(tokenizer, prompt, where="demonstration", tools=tools)
    loss_mask = [0] * len(token_ids)
    messages = environment.reset(row)
    for index, text in enumerate(turns):
        turn_ids = tokenizer.encode(text, add_special_tokens=False) + [delta.turn_end_id]
        token_ids += turn_ids
        loss_mask += [1] * len(turn_ids)
        result = environment.step(messages, text)
        messages.append({"role": "assistant", "content": text})
        last = index == len(turns) - 1
        if result.done != last:
            raise ValueError(
                f"the environment {'ended' if result.done else 'did not end'} the conversation after turn {index} of "
                f"a {len(turns)}-turn demonstration ({text!r:.80})"
            )
        if not last:
            observation_ids = delta.observation_ids(result.observations, **template_context({**row, "prompt": prompt}))
            token_ids += observation_ids
            loss_mask += [0] * len(observation_ids)
            messages += result.observations
    return token_ids, loss_mask


def warm_start(
    model_dir: str,
    demonstrations: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int = 32,
    micro_batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Fit the causal LM at ``model_dir`` to ``demonstrations`` ((token ids, loss mask) pairs) for ``steps`` AdamW
    steps of ``batch_size`` rows drawn with a generator seeded by ``seed``; save it back in place. Returns each step's
    mean cross-entropy over the masked tokens.

    A step's rows run sorted by length in micro-batches of ``micro_batch_size``, each padded to its own longest row
    (the demonstrations' lengths differ up to 6x, so one batch padded to its longest row would be a third padding);
    their losses are summed over the whole batch's masked tokens, so the gradient is the batch's mean."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pad_id = model.config.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses = []
    model.train()
    for _ in range(steps):
        rows = sorted(
            (demonstrations[rng.randrange(len(demonstrations))] for _ in range(batch_size)), key=lambda row: len(row[0])
        )
        masked_tokens = sum(sum(mask) for _, mask in rows)
        optimizer.zero_grad()
        step_loss = 0.0
        for start in range(0, batch_size, micro_batch_size):
            micro_batch = rows[start : start + micro_batch_size]
            width = max(len(ids) for ids, _ in micro_batch)
            input_ids = torch.full((len(micro_batch), width), pad_id, dtype=torch.long)
            labels = torch.full((len(micro_batch), width), -100, dtype=torch.long)
            attention_mask = torch.zeros((len(micro_batch), width), dtype=torch.long)
            for row, (ids, mask) in enumerate(micro_batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
                labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
            # The loss mask never covers a row's first token, which no label predicts: the shifted labels count
            # exactly the masked tokens.
            loss = model(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=masked_tokens
            ).loss
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        losses.append(step_loss)
    model.save_pretrained(model_dir, safe_serialization=True)
    return losses


def make_tool_products_policy(out_dir: str, *, demonstrations: int = 192, steps: int = 300, seed: int = 0) -> str:
    """A tiny llama (tokenizer trained on the tool task's text too) warm-started on ``demonstrations`` tool_products
    demonstrations, the three kinds in turn (``task.tool_products_demonstration``: a good calculator call, a
    broken one, a guess), answered by the real sandboxed calculator; returns ``out_dir``. Sampled at temperature 1,
    about a third of its trajectories make a call that succeeds: a starting point RL can improve. About 15 s on a CPU
    core."""
    make_tiny(family="llama", out_dir=out_dir, tokenizer_tasks=("arithmetic", "tool_products"), seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    delta, environment, rng = ChatDelta(tokenizer), ToolEnvironment(), random.Random(seed)
    rows = make_rows(task="tool_products", train_size=demonstrations, val_size=1, seed=seed + 1)["train"]
    kinds = TOOL_DEMONSTRATION_KINDS * len(rows)
    laid_out = [
        demonstration_tokens(
            tokenizer,
            delta,
            row,
            tool_products_demonstration(row, kind=kind, guess=rng.randint(100, 9801)),
            environment,
        )
        for row, kind in zip(rows, kinds)
    ]
    warm_start(out_dir, laid_out, steps=steps, seed=seed)
    return out_dir
