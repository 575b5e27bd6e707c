"""GRPO (Shao et al. 2024) and its critic-free family: each prompt's n responses are scored against a baseline
from the group. ``algorithm.name`` picks the estimator: grpo (mean/std; ``normalize_advantages=false`` is Dr. GRPO),
rloo (leave-one-out mean), reinforce_pp (REINFORCE++: whitened returns) or reinforce_pp_baseline. DAPO's pieces
are switches too: ``clip_ratio_high`` (clip-higher), ``dynamic_sampling``, ``overlong_buffer``; GSPO is
``policy_loss=gspo``.

    torchrun --nproc-per-node 4 recipes/grpo.py --config recipes/configs/grpo.yaml trainer.total_steps=20
    torchrun --nproc-per-node 4 recipes/grpo.py algorithm.name=rloo
"""

from __future__ import annotations

import time

from spmd_rlhf.config import dataflow
from spmd_rlhf.controller import RLRecipe, main
from spmd_rlhf.metrics.step_metrics import StageTimer


class GRPORecipe(RLRecipe):
    name = "grpo"
    dataflow = dataflow.GRPO

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        experience = self.experience(step, timer)  # rollout, scores, old and reference log-probs
        inputs = experience.batches
        estimator = self.config.algorithm.name
        with timer("advantages"):
            advantages = self.actor.compute_advantages(
                *inputs, estimator=estimator, kl_coef=self.kl_controller.coef
            ).result()
        with timer("update_actor"):
            actor_metrics = self.actor.update_actor(*inputs, advantages, **self.update_options(step)).result()
        return self.step_metrics(started, timer, experience, advantages, actor_metrics)


if __name__ == "__main__":
    main(GRPORecipe, "recipes/configs/grpo.yaml")
