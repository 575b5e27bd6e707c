"""Recipes: the single-controller RL loops (PPO, GRPO, ...), importable as ``spmd_rlhf.recipes``."""
