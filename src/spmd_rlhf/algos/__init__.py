"""RL algorithms as pure tensor functions: advantages, losses, KL estimators and controllers, loss aggregation."""

from .advantages import broadcast_to_tokens, gae, group_advantages, scores_to_token_rewards, whiten
from .aggregation import AGGREGATIONS, Denominators, aggregate, masked_mean
from .kl import ESTIMATORS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_estimate
from .losses import entropy_bonus, policy_loss, value_loss

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "AdaptiveKLController",
    "Denominators",
    "FixedKLController",
    "aggregate",
    "apply_kl_penalty",
    "broadcast_to_tokens",
    "entropy_bonus",
    "gae",
    "group_advantages",
    "kl_estimate",
    "masked_mean",
    "policy_loss",
    "scores_to_token_rewards",
    "value_loss",
    "whiten",
]
