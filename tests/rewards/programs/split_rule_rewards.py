"""A rule-reward role with tp=2 (one DP replica over both ranks) scores a batch, inline and with one worker process
per rank; the scores and metrics are saved.

    torchrun --nproc-per-node 2 split_rule_rewards.py TOKENIZER_DIR REWARD_FILE OUT.pt
"""

import sys

import torch
from transformers import AutoTokenizer

from spmd_rlhf.config import load_config
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import RewardWorker

ROWS = 16


def answer_batch(tokenizer) -> Batch:
    """Right-padded responses ``"<i % 7>"``, ground truths ``"<i % 5>"``: some right, some wrong."""
    encoded = [tokenizer(f" {index % 7}")["input_ids"] for index in range(ROWS)]
    length = max(len(ids) for ids in encoded)
    responses = torch.tensor([ids + [0] * (length - len(ids)) for ids in encoded])
    mask = torch.tensor([[1] * len(ids) + [0] * (length - len(ids)) for ids in encoded])
    return Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": ["my/source"] * ROWS,
            "ground_truth": [str(index % 5) for index in range(ROWS)],
            "extra_info": [{"index": index} for index in range(ROWS)],
        },
        group_size=2,
    )


def main(coordinator):
    tokenizer_dir, reward_file, out = sys.argv[1:4]
    batch = answer_batch(AutoTokenizer.from_pretrained(tokenizer_dir))
    results = {"responses": batch["responses"], "response_mask": batch["response_mask"]}
    for workers in (0, 1):
        config = load_config(
            None,
            [
                f"model.path={tokenizer_dir}",
                f"reward.rule={reward_file}:score",
                f"reward.num_workers={workers}",
            ],
        )
        reward = coordinator.spawn(
            RewardWorker, config, name=f"reward_{workers}", pool=ResourcePool([0, 1]), dims=ParallelDims(tp=2)
        )
        scores = reward.compute_rewards(batch).result()
        results[f"scores_{workers}"] = scores.fetch()["scores"]
        results[f"metrics_{workers}"] = scores.meta["metrics"]
    torch.save(results, out)


if __name__ == "__main__":
    launch(main)
