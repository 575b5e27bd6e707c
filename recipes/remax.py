"""ReMax (Li et al. 2023): REINFORCE whose baseline is the reward of each prompt's greedy response; no critic.

The step is GRPO's with one more generation: a greedy response per prompt, scored by the same reward. With a rollout
role (asynchronous RL), the rollout generates it right behind the step's batch, at the same policy version.

    torchrun --nproc-per-node 4 recipes/remax.py --config recipes/configs/remax.yaml trainer.total_steps=20
"""

from __future__ import annotations

import time

from spmd_rlhf.config import dataflow
from spmd_rlhf.controller import RLRecipe, main
from spmd_rlhf.metrics.step_metrics import StageTimer


class ReMaxRecipe(RLRecipe):
    name = "remax"
    dataflow = dataflow.REMAX

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        experience = self.experience(step, timer)  # rollout, scores, old and reference log-probs
        inputs = experience.batches
        with timer("baseline"):
            if "rollout" in self.roles:  # generated and scored on the rollout side with the step's batch
                baseline = self.pipeline.baseline(step).result()
            else:
                greedy = self.actor.generate_sequences(self.loader.batch(step), greedy=True)
                baseline = self.reward.compute_rewards(greedy).result()
        with timer("advantages"):
            advantages = self.actor.compute_advantages(
                *inputs, estimator="remax", baseline=baseline, kl_coef=self.kl_controller.coef
            ).result()
        with timer("update_actor"):
            actor_metrics = self.actor.update_actor(*inputs, advantages, **self.update_options(step)).result()
        metrics = self.step_metrics(started, timer, experience, advantages, actor_metrics)
        metrics["baseline/reward/mean"] = baseline.meta["metrics"]["reward/mean"]
        return metrics


if __name__ == "__main__":
    main(ReMaxRecipe, "recipes/configs/remax.yaml")
