"""RL algorithms as pure tensor functions: advantages, losses, KL estimators and controllers, loss aggregation,
evaluation statistics (pass@k)."""

from spmd_rlhf.algos.advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae,
    group_advantages,
    groups_with_signal,
    overlong_penalty,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
    whiten,
)
from spmd_rlhf.algos.aggregation import AGGREGATIONS, Denominators, aggregate, masked_mean
from spmd_rlhf.algos.evaluation import pass_at_k
from spmd_rlhf.algos.kl import ESTIMATORS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_estimate
from spmd_rlhf.algos.losses import (
    RATIO_LEVELS,
    cispo_loss,
    entropy_bonus,
    gmpo_loss,
    policy_loss,
    sapo_loss,
    value_loss,
)
from spmd_rlhf.algos.off_policy import LEVELS, Corrected, Correction, correct, correction_metrics
from spmd_rlhf.algos.safe_rlhf import LagrangeMultiplier, combine_advantages

__all__ = [
    "AGGREGATIONS",
    "LEVELS",
    "Corrected",
    "Correction",
    "ESTIMATORS",
    "AdaptiveKLController",
    "LagrangeMultiplier",
    "RATIO_LEVELS",
    "Denominators",
    "FixedKLController",
    "aggregate",
    "apply_kl_penalty",
    "broadcast_to_tokens",
    "combine_advantages",
    "discounted_returns",
    "entropy_bonus",
    "gae",
    "group_advantages",
    "groups_with_signal",
    "cispo_loss",
    "correct",
    "correction_metrics",
    "gmpo_loss",
    "kl_estimate",
    "masked_mean",
    "overlong_penalty",
    "pass_at_k",
    "policy_loss",
    "remax_advantages",
    "rloo_advantages",
    "sapo_loss",
    "scores_to_token_rewards",
    "value_loss",
    "whiten",
]
