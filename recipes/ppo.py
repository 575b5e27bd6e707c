"""PPO (Ouyang et al. 2022) with a critic, GAE and a KL-to-reference penalty in the reward.

    torchrun --nproc-per-node 4 recipes/ppo.py --config recipes/configs/ppo.yaml trainer.total_steps=20
"""

from __future__ import annotations

import time

from spmd_rlhf.metrics import StageTimer
from spmd_rlhf.recipes.base import RLRecipe, main


class PPORecipe(RLRecipe):
    name = "ppo"

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        prompts = self.loader.batch(step)
        with timer("generate"):
            rollout = self.actor.generate_sequences(prompts).result()
        with timer("reward"):
            scores = self.reward.compute_rewards(rollout).result()
        with timer("old_log_probs"):
            old_log_probs = self.actor.compute_log_probs(rollout).result()
        with timer("values"):
            values = self.critic.compute_values(rollout).result()
        inputs = [rollout, scores, old_log_probs, values]
        if "reference" in self.roles:
            with timer("ref_log_probs"):
                inputs.append(self.reference.compute_log_probs(rollout).result())
        with timer("advantages"):
            advantages = self.actor.compute_advantages(*inputs, estimator="gae").result()
        with timer("update_critic"):
            critic_metrics = self.critic.update_critic(rollout, values, advantages).result()
        with timer("update_actor"):
            actor_metrics = self.actor.update_actor(*inputs, advantages).result()
        metrics = self.collect(timer, rollout, scores, advantages, critic_metrics, actor_metrics)
        self.add_throughput(metrics, time.perf_counter() - started)
        return metrics


if __name__ == "__main__":
    main(PPORecipe, "recipes/configs/ppo.yaml")
