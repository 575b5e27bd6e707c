"""A custom controller loop built on a recipe class: GRPO whose advantage stage uses RLOO's leave-one-out baseline
and which logs the share of responses that hit the length limit. Everything else (setup, rollouts, rewards,
reference log-probs, the update) is ``GRPORecipe``'s.

    torchrun --nproc-per-node 2 recipes/examples/custom_loop.py 5
"""

from __future__ import annotations

import sys
import time

from spmd_rlhf.config import load_config
from spmd_rlhf.metrics.step_metrics import StageTimer
from spmd_rlhf.recipes.grpo import GRPORecipe
from spmd_rlhf.runtime import launch


class LeaveOneOutGRPO(GRPORecipe):
    """GRPO with one stage changed: the advantages."""

    def step(self, step: int) -> dict[str, float]:
        started, timer = time.perf_counter(), StageTimer()
        experience = self.experience(step, timer)
        inputs = experience.batches
        with timer("advantages"):
            advantages = self.actor.compute_advantages(
                *inputs, estimator="rloo", kl_coef=self.kl_controller.coef
            ).result()
        with timer("update_actor"):
            actor_metrics = self.actor.update_actor(*inputs, advantages, kl_coef=self.kl_controller.coef).result()
        metrics = self.step_metrics(started, timer, experience, advantages, actor_metrics)
        metrics["custom/clipped_share"] = metrics["response_length/clip_ratio"]
        return metrics


def main(coordinator) -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    config = load_config(
        "recipes/configs/grpo.yaml",
        [f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.output_dir=outputs/custom"],
    )
    recipe = LeaveOneOutGRPO(config, coordinator)
    recipe.setup()
    for step in range(steps):  # a plain loop: no fit(), no checkpoints
        metrics = recipe.step(step)
        print(
            f"step {step}: reward {metrics['reward/mean']:.4f} clipped {metrics['custom/clipped_share']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    launch(main)
