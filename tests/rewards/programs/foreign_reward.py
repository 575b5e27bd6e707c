"""A reward model and a cost model with a tokenizer of their own (another vocabulary and chat template) on 2 DP ranks
score rollout rows made in the policy's tokens; the scores and costs are saved.

    torchrun --nproc-per-node 2 foreign_reward.py POLICY_DIR SCORER_DIR ROWS.json OUT.pt

ROWS.json holds ``[raw_prompt, response_text, ends_with_eos]`` triples, an even number of them.
"""

import json
import sys

import torch
from transformers import AutoTokenizer

from spmd_rlhf.config import load_config
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.data.dataset import encode_prompt
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import RewardWorker


def policy_rollout(tokenizer, rows: list) -> Batch:
    """The rollout layout of ``rows`` in the policy's tokens: prompts left-padded, responses right-padded."""
    prompts = [encode_prompt(tokenizer, raw_prompt, where="test") for raw_prompt, _, _ in rows]
    responses = [
        tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
        for _, text, eos in rows
    ]
    prompt_width, response_width = max(map(len, prompts)), max(map(len, responses))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (prompt_width - len(ids)) + ids for ids in prompts])
    response_ids = torch.tensor([ids + [pad] * (response_width - len(ids)) for ids in responses])
    prompt_mask = torch.tensor([[0] * (prompt_width - len(ids)) + [1] * len(ids) for ids in prompts])
    response_mask = torch.tensor([[1] * len(ids) + [0] * (response_width - len(ids)) for ids in responses])
    return Batch(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        },
        {"raw_prompt": [raw_prompt for raw_prompt, _, _ in rows]},
        group_size=2,
    )


def main(coordinator):
    policy_dir, scorer_dir, rows_file, out = sys.argv[1:5]
    rows = json.loads(open(rows_file).read())
    batch = policy_rollout(AutoTokenizer.from_pretrained(policy_dir), rows)
    config = load_config(
        None,
        [
            f"model.path={policy_dir}",
            "reward.kind=model",
            f"reward.model_path={scorer_dir}",
            "reward.micro_batch_size=3",
            f"cost.model_path={scorer_dir}",
        ],
    )
    pool, dims = ResourcePool([0, 1]), ParallelDims(dp=2)
    reward = coordinator.spawn(RewardWorker, config, name="reward", pool=pool, dims=dims)
    cost = coordinator.spawn(RewardWorker, config, name="cost", pool=pool, dims=dims, role="cost")
    scores = reward.compute_rewards(batch).result()
    costs = cost.compute_rewards(batch).result()
    torch.save(
        {
            "scores": scores.fetch()["scores"],
            "costs": costs.fetch()["costs"],
            "score_mean": scores.meta["metrics"]["reward/mean"],
            "policy_input_ids": batch["input_ids"],
            "policy_attention_mask": batch["attention_mask"],
        },
        out,
    )


if __name__ == "__main__":
    launch(main)
