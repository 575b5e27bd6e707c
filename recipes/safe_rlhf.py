"""Safe-RLHF (Dai et al. 2023): PPO on the reward under a cost constraint E[cost] <= algorithm.cost_limit, with a
cost model, a cost critic beside the reward critic, and a Lagrange multiplier λ.

The step is PPO's with the cost mirrored (score, values, GAE, critic update) and the policy following
(A_reward − λ·A_cost) / (1 + λ); λ then takes one ascent step on the batch's mean cost and is checkpointed.

    torchrun --nproc-per-node 4 recipes/safe_rlhf.py --config recipes/configs/safe_rlhf.yaml trainer.total_steps=20
"""

from __future__ import annotations

import time
from typing import Any

from spmd_rlhf.algos import LagrangeMultiplier
from spmd_rlhf.config import dataflow
from spmd_rlhf.controller import RLRecipe, main
from spmd_rlhf.metrics.step_metrics import StageTimer


class SafeRLHFRecipe(RLRecipe):
    name = "safe_rlhf"
    dataflow = dataflow.SAFE_RLHF

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        algorithm = self.config.algorithm
        self.multiplier = LagrangeMultiplier(
            algorithm.lambda_init,
            lr=algorithm.lambda_lr,
            threshold=algorithm.cost_limit,
            max_value=algorithm.lambda_max,
        )

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        experience = self.experience(
            step,
            timer,
            values=self.critic.compute_values,
            costs=self.cost.compute_rewards,
            cost_values=self.cost_critic.compute_values,
        )
        inputs, rollout, values = experience.batches, experience.rollout, experience.extras["values"]
        costs, cost_values = experience.extras["costs"], experience.extras["cost_values"]
        with timer("advantages"):
            advantages = self.actor.compute_advantages(
                *inputs, values, estimator="gae", kl_coef=self.kl_controller.coef
            ).result()
            cost_advantages = self.actor.compute_advantages(
                rollout, costs, cost_values, estimator="gae", source="cost"
            ).result()
        # The critics and the actor train at the same time when they are placed on different devices.
        critic_metrics, cost_critic_metrics, actor_metrics = self.run_together(
            timer,
            update_critic=self.critic.update_critic(rollout, values, advantages),
            update_cost_critic=self.cost_critic.update_critic(rollout, cost_values, cost_advantages),
            update_actor=self.actor.update_actor(
                *inputs,
                advantages,
                cost_advantages,
                kl_coef=self.kl_controller.coef,
                cost_multiplier=self.multiplier.value,
            ),
        )
        metrics = self.step_metrics(
            started,
            timer,
            experience,
            costs,
            advantages,
            cost_advantages,
            critic_metrics,
            cost_critic_metrics,
            actor_metrics,
        )
        metrics["lambda"] = self.multiplier.value
        self.multiplier.update(metrics["cost/mean"])
        return metrics

    def algorithm_state(self) -> dict[str, Any]:
        return {**super().algorithm_state(), "lambda": self.multiplier.value}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        super().load_algorithm_state(state)
        self.multiplier.value = float(state["lambda"])


if __name__ == "__main__":
    main(SafeRLHFRecipe, "recipes/configs/safe_rlhf.yaml")
