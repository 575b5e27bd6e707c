"""Load a checkpoint into a recipe on this job's ranks (any number: a resume into another world size), write each
trained role's weights as it holds them after loading (``OUT/<role>``), then run the next step and write its metrics
to ``OUT/metrics.json``.

    torchrun --nproc-per-node 1 tests/recipes/programs/load_checkpoint.py ppo CKPT_DIR OUT [key=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spmd_rlhf.config import load_config
from spmd_rlhf.recipes.grpo import GRPORecipe
from spmd_rlhf.recipes.ppo import PPORecipe
from spmd_rlhf.runtime import Coordinator, launch

RECIPES = {"grpo": GRPORecipe, "ppo": PPORecipe}
CONFIGS = Path(__file__).parents[3] / "recipes" / "configs"


def main(coordinator: Coordinator) -> None:
    name, checkpoint_dir, out_dir, *overrides = sys.argv[1:]
    recipe = RECIPES[name](load_config(str(CONFIGS / f"{name}.yaml"), overrides), coordinator)
    recipe.setup()
    step = recipe.load(checkpoint_dir)
    for role in recipe.trained_roles():
        recipe.roles[role].save_pretrained(str(Path(out_dir, role))).result()
    metrics = recipe.step(step)
    Path(out_dir, "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    launch(main)
