"""PPO (Ouyang et al. 2022) with a critic, GAE and a KL-to-reference penalty in the reward.

torchrun --nproc-per-node 4 recipes/ppo.py --config recipes/configs/ppo.yaml trainer.total_steps=20
"""

from __future__ import annotations

import time

from spmd_rlhf.config import dataflow
from spmd_rlhf.controller import RLRecipe, main
from spmd_rlhf.metrics.step_metrics import StageTimer


class PPORecipe(RLRecipe):
    name = "ppo"
    dataflow = dataflow.PPO

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        experience = self.experience(step, timer, values=self.critic.compute_values)
        inputs, rollout, values = experience.batches, experience.rollout, experience.extras["values"]
        with timer("advantages"):
            advantages = self.actor.compute_advantages(
                *inputs, values, estimator="gae", kl_coef=self.kl_controller.coef
            ).result()
        # The critics and the actor train at the same time when they are placed on different devices.
        critic_metrics, actor_metrics = self.run_together(
            timer,
            update_critic=self.critic.update_critic(rollout, values, advantages),
            update_actor=self.actor.update_actor(*inputs, advantages, **self.update_options(step)),
        )
        return self.step_metrics(started, timer, experience, advantages, critic_metrics, actor_metrics)


if __name__ == "__main__":
    main(PPORecipe, "recipes/configs/ppo.yaml")
