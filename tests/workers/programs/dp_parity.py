"""update_actor on one batch by three actors on the same 4 ranks: dp=1, dp=2, dp=4; each saves its weights.

    torchrun --nproc-per-node 4 dp_parity.py MODEL_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker


def rollout_batch(rows: int, prompt_length: int, response_length: int, vocab: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, vocab, (rows, prompt_length), generator=generator)
    prompt_mask = torch.ones(rows, prompt_length, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # some left padding
    lengths = torch.randint(1, response_length + 1, (rows,), generator=generator)
    response_mask = (torch.arange(response_length)[None] < lengths[:, None]).long()
    responses = torch.randint(5, vocab, (rows, response_length), generator=generator) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "old_log_probs": -torch.rand(rows, response_length, generator=generator) * 3,
            "ref_log_probs": -torch.rand(rows, response_length, generator=generator) * 3,
            "advantages": torch.randn(rows, response_length, generator=generator) * response_mask,
        },
        group_size=2,
    )


def main(coordinator):
    model_dir, out_dir, aggregation = sys.argv[1], sys.argv[2], sys.argv[3]
    config = load_config(None, [
        f"model.path={model_dir}", "algorithm.name=grpo", "algorithm.kl_penalty=loss", "algorithm.entropy_coef=0.01",
        f"algorithm.loss_aggregation={aggregation}", "critic.enabled=false", "rollout.n=2", "rollout.max_new_tokens=6",
        "actor.lr=1e-3", "actor.mini_batch_size=16", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "data.batch_size=8",
    ])
    batch = rollout_batch(16, 5, 6, vocab=100)
    for dp in (1, 2, 4):
        actor = coordinator.spawn(ActorWorker, config, name=f"actor_dp{dp}", pool=ResourcePool(range(dp)), dims=ParallelDims(dp=dp))
        metrics = actor.update_actor(batch).result()  # one dict per DP rank
        Path(f"{out_dir}/dp{dp}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/dp{dp}").result()


if __name__ == "__main__":
    launch(main)
