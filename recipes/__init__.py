"""Recipes: the algorithm classes a user copies to write their own loop (PPO, GRPO and its family, ReMax,
Safe-RLHF), each with its torchrun entry, plus ``configs/``, ``slurm/`` and ``examples/``. The framework they build on
is ``spmd_rlhf.controller``. Importable as ``spmd_rlhf.recipes``: ``from spmd_rlhf.recipes import PPORecipe``."""

from spmd_rlhf.recipes.grpo import GRPORecipe
from spmd_rlhf.recipes.ppo import PPORecipe
from spmd_rlhf.recipes.remax import ReMaxRecipe
from spmd_rlhf.recipes.rloo import RLOORecipe
from spmd_rlhf.recipes.safe_rlhf import SafeRLHFRecipe
