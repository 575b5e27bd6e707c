"""A reward model (score head) and a critic (value head) on 2 DP ranks score one rollout batch; results fetched.

torchrun --nproc-per-node 2 scoring_roles.py POLICY_DIR REWARD_DIR CRITIC_DIR OUT.pt
"""

import sys

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import CriticWorker, RewardWorker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_parity import rollout_batch  # noqa: E402


def main(coordinator):
    policy_dir, reward_dir, critic_dir, out = sys.argv[1:5]
    config = load_config(
        None,
        [
            f"model.path={policy_dir}",
            "reward.kind=model",
            f"reward.model_path={reward_dir}",
            "reward.micro_batch_size=3",
            f"critic.model_path={critic_dir}",
            "critic.forward_micro_batch_size=4",
            "rollout.max_new_tokens=6",
        ],
    )
    batch = rollout_batch(16, 5, 6, vocab=100)
    pool, dims = ResourcePool([0, 1]), ParallelDims(dp=2)
    reward = coordinator.spawn(RewardWorker, config, name="reward", pool=pool, dims=dims)
    critic = coordinator.spawn(CriticWorker, config, name="critic", pool=pool, dims=dims)
    scores = reward.compute_rewards(batch).result()
    values = critic.compute_values(batch).result()
    torch.save(
        {
            "batch": batch.tensors,
            "scores": scores.fetch()["scores"],
            "values": values.fetch()["values"],
            "score_mean": scores.meta["metrics"]["reward/mean"],
        },
        out,
    )


if __name__ == "__main__":
    launch(main)
