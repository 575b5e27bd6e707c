"""Each recipe family's dataflow is declared once (``spmd_rlhf.config.dataflow``) and the recipes, config validation,
the mapper's workload and the recipes' role attributes follow it."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmd_rlhf.config import ConfigError, dataflow, load_config
from spmd_rlhf.controller.recipe import Experience
from spmd_rlhf.mapping.workload import NAMED_SHAPES
from spmd_rlhf.mapping.workload import dataflow as model_roles
from spmd_rlhf.recipes.grpo import GRPORecipe
from spmd_rlhf.recipes.ppo import PPORecipe
from spmd_rlhf.recipes.remax import ReMaxRecipe
from spmd_rlhf.recipes.rloo import RLOORecipe
from spmd_rlhf.recipes.safe_rlhf import SafeRLHFRecipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE_CLASSES = {
    "ppo": PPORecipe,
    "grpo": GRPORecipe,
    "remax": ReMaxRecipe,
    "rloo": RLOORecipe,
    "safe_rlhf": SafeRLHFRecipe,
}


def test_every_algorithm_has_one_recipe_family_and_each_recipe_runs_its_own_family():
    families = {recipe.dataflow.family: recipe for recipe in RECIPE_CLASSES.values() if recipe is not RLOORecipe}
    assert {algorithm.dataflow.family for algorithm in dataflow.ALGORITHMS.values()} == set(families)
    for recipe in RECIPE_CLASSES.values():
        assert recipe.runs() and all(dataflow.ALGORITHMS[name].dataflow is recipe.dataflow for name in recipe.runs())
    assert GRPORecipe.runs() == ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    assert RLOORecipe.runs() == ("rloo",)  # a named entry point of the GRPO family


@pytest.mark.parametrize("name", sorted(RECIPE_CLASSES))
def test_each_default_config_enables_exactly_the_roles_its_dataflow_uses(name):
    config = load_config(RECIPES / "configs" / f"{name}.yaml", [])
    assert list(config.enabled_roles()) == list(RECIPE_CLASSES[name].dataflow.roles_of(config))


def test_conditions_switch_work_on_and_off():
    config = load_config(RECIPES / "configs" / "grpo.yaml", ["rollout.recompute_log_probs=true"])
    roles = dataflow.GRPO.roles_of(config)
    assert roles["actor"] == {"generation": ("generate",), "preparation": ("forward",), "training": ("train",)}
    assert roles["reference"] == {"preparation": ("forward",)}
    config = load_config(RECIPES / "configs" / "grpo.yaml", ["algorithm.kl_penalty=none", "reference.enabled=false"])
    assert "reference" not in dataflow.GRPO.roles_of(config)
    assert not load_config(RECIPES / "configs" / "grpo.yaml", ["algorithm.kl_penalty=none"]).reference.enabled
    with pytest.raises(ConfigError, match="algorithm.kl_penalty=none never calls the reference"):
        load_config(RECIPES / "configs" / "grpo.yaml", ["algorithm.kl_penalty=none", "reference.enabled=true"])
    shape = NAMED_SHAPES["7b"]
    actor = model_roles("ppo", actor=shape, critic=shape, recompute_log_probs=True)[0]
    assert actor.work["preparation"] == ("forward",)


def test_the_mapper_sees_the_cost_critic_with_its_own_shape():
    big, small = NAMED_SHAPES["13b"], NAMED_SHAPES["7b"]
    roles = {
        role.name: role for role in model_roles("safe_rlhf", actor=small, critic=small, cost_critic=big, cost=small)
    }
    assert roles["cost_critic"].shape == big and roles["cost_critic"].trained and roles["cost"].head == "score"


def test_a_role_the_run_lacks_is_a_clear_error():
    recipe = GRPORecipe(load_config(RECIPES / "configs" / "grpo.yaml", []), coordinator=None)
    with pytest.raises(RuntimeError, match="call setup"):
        _ = recipe.actor
    recipe.roles = {"actor": "actor handle", "reference": "reference handle", "reward": "reward handle"}
    assert recipe.actor == "actor handle"
    with pytest.raises(RuntimeError, match="the critic is not in this run: .* uses actor, reference, reward"):
        _ = recipe.critic


def test_experience_batches_are_the_actor_inputs_once_each():
    rollout, scores, reference = object(), object(), object()
    assert Experience(rollout, scores, ref_log_probs=reference).batches == [rollout, scores, reference]
    # Dynamic sampling: the rows carry their scores, so the rollout is given once.
    assert Experience(rollout, rollout).batches == [rollout]
