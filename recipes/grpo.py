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
        prompts = self.loader.batch(step)
        with timer("generate"):
            rollout = self.actor.generate_sequences(prompts).result()
        with timer("reward"):
            scores = self.reward.compute_rewards(rollout).result()
        with timer("old_log_probs"):
            old_log_probs = self.actor.compute_log_probs(rollout).result()
        inputs = [rollout, scores, old_log_probs]
        if "reference" in self.roles:
            with timer("ref_log_probs"):
                inputs.append(self.reference.compute_log_probs(rollout).result())
        with timer("advantages"):
            advantages = self.actor.compute_advantages(*inputs, estimator="grpo").result()
        with timer("update_actor"):
            actor_metrics = self.actor.update_actor(*inputs, advantages).result()
        metrics = self.collect(timer, rollout, scores, advantages, actor_metrics)
        self.add_throughput(metrics, time.perf_counter() - started)
        return metrics


if __name__ == "__main__":
    main(GRPORecipe, "recipes/configs/grpo.yaml")
