"""GRPO (Shao et al. 2024): no critic; each prompt's n responses are scored against their group's mean.

    torchrun --nproc-per-node 4 recipes/grpo.py --config recipes/configs/grpo.yaml trainer.total_steps=20
"""

from __future__ import annotations

import time

from spmd_rlhf.metrics import StageTimer
from spmd_rlhf.recipes.base import RLRecipe, main


class GRPORecipe(RLRecipe):
    name = "grpo"

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        inputs = self.experience(step, timer)  # rollout, scores, old and reference log-probs
        with timer("advantages"):
            advantages = self.actor.compute_advantages(*inputs, estimator="grpo", kl_coef=self.kl_controller.coef).result()
        with timer("update_actor"):
            actor_metrics = self.actor.update_actor(*inputs, advantages, kl_coef=self.kl_controller.coef).result()
        return self.step_metrics(started, timer, *inputs, advantages, actor_metrics)


if __name__ == "__main__":
    main(GRPORecipe, "recipes/configs/grpo.yaml")
