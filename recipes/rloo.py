"""RLOO (Ahmadian et al. 2024): GRPO's step with each sample's baseline the mean reward of its prompt's other
samples. A recipe class is an algorithm family (``spmd_rlhf.config.dataflow``): this is ``GRPORecipe``, its loop and
dataflow, as a named entry point with its own config, running ``algorithm.name=rloo`` only.

    torchrun --nproc-per-node 4 recipes/rloo.py --config recipes/configs/rloo.yaml trainer.total_steps=20
"""

from __future__ import annotations

from spmd_rlhf.controller import main
from spmd_rlhf.recipes.grpo import GRPORecipe


class RLOORecipe(GRPORecipe):
    name = "rloo"
    algorithms = ("rloo",)


if __name__ == "__main__":
    main(RLOORecipe, "recipes/configs/rloo.yaml")
