"""``algorithm``: the RL algorithm, its advantage estimator, loss, KL and off-policy settings."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rlhf.config import dataflow
from spmd_rlhf.config.dataflow import GROUP_ALGORITHMS
from spmd_rlhf.config.errors import at_least, listed, one_of, require

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""The modes of ``spmd_rlhf.algos.aggregate`` (a test keeps the two lists equal)."""


ALGORITHMS = tuple(dataflow.ALGORITHMS)
"""Every ``algorithm.name``: the members of every family's dataflow."""


@dataclass
class AlgorithmConfig:
    name: str = "ppo"
    """ppo, grpo, remax, rloo, reinforce_pp (REINFORCE++), reinforce_pp_baseline (REINFORCE++ with a group-mean
    baseline) or safe_rlhf (PPO-Lagrangian with a cost model and a cost critic)."""
    gamma: float = 1.0
    """Discount factor of returns and GAE."""
    lam: float = 0.95
    """GAE lambda: 0 gives one-step TD advantages, 1 gives Monte Carlo returns minus values."""
    kl_coef: float = 0.01
    """Weight of the KL(actor || reference) term (the initial weight with kl_target)."""
    kl_target: float | None = None
    """Adaptive KL (Ziegler et al. 2019): steer the weight towards this mean per-sequence KL; null: fixed kl_coef."""
    kl_horizon: int = 10000
    """Adaptive KL: responses over which a full +/-20% correction of the weight is applied."""
    kl_estimator: str = "k1"
    """Per-token KL estimate from r = pi_ref / pi (Schulman): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    kl_penalty: str = "reward"
    """Where the KL term goes: reward (subtracted from per-token rewards), loss (added to the policy loss) or none."""
    clip_ratio_low: float = 0.2
    """The policy ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    clip_ratio_high: float = 0.2
    """Upper side of the ratio clip; raise it (e.g. 0.28) for DAPO's clip-higher."""
    value_clip: float | None = 0.2
    """Critic loss: clip new values to old values +/- this; null: no clipping."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    normalize_advantages: bool = True
    """Whiten advantages over the batch; for grpo, divide each group by its std (false gives Dr. GRPO)."""
    loss_aggregation: str = "token_mean"
    """Per-token losses to one number over the global batch: token_mean, seq_mean_token_mean, seq_mean_token_sum or
    seq_mean_token_sum_norm (Dr. GRPO: divide by sequences x max response length)."""
    policy_loss: str = "ppo"
    """Importance ratio of the clipped policy loss: ppo (per token) or gspo (per sequence, Zheng et al. 2025; use
    small clip ratios such as 3e-4 / 4e-4)."""
    dynamic_sampling: bool = False
    """DAPO: drop prompts whose samples all scored the same and refill the batch from further prompts (grpo family)."""
    max_sampling_rounds: int = 3
    """DAPO dynamic sampling: generation rounds per step at most; a batch still short after them is used as it is."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the last this many tokens before rollout.max_new_tokens cost up to
    overlong_penalty linearly; 0: off."""
    overlong_penalty: float = 1.0
    """DAPO: the score subtracted from a response of rollout.max_new_tokens tokens when overlong_buffer > 0."""
    cost_limit: float = 0.0
    """safe_rlhf: the expected cost the policy must stay under (threshold d of the Lagrangian)."""
    lambda_init: float = 1.0
    """safe_rlhf: initial Lagrange multiplier of the cost constraint (> 0; it is log-parameterised)."""
    lambda_lr: float = 0.1
    """safe_rlhf: learning rate of the Lagrange multiplier."""
    lambda_max: float | None = None
    """safe_rlhf: upper bound of the Lagrange multiplier; null: none."""
    max_staleness: int = 0
    """Asynchronous RL: how many policy updates a step's samples may lag the policy they train (k). 0: every step
    trains on samples of its own weights (synchronous); 1: one-step-off (the next batch is generated while this one
    trains); k: a k-deep pipeline. k > 0 turns on rollout.enabled and rollout.recompute_log_probs (left null)."""
    off_policy_correction: str = "truncated"
    """With max_staleness > 0, the importance weight w = pi_old / pi_behaviour (recomputed over engine log-probs) of
    each token: truncated (min(w, importance_cap)) or masked (tokens with w > importance_cap leave the loss)."""
    importance_cap: float = 2.0
    """With max_staleness > 0: the cap of the importance weights (> 1)."""

    def __post_init__(self) -> None:
        one_of(self, "name", ALGORITHMS)
        for name in ("gamma", "lam"):
            require(self, name, 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        at_least(self, 0, "kl_coef", "entropy_coef", "lambda_init")
        at_least(self, 1, "kl_horizon")
        require(self, "kl_target", self.kl_target is None or self.kl_target > 0, "must be > 0 or null")
        one_of(self, "kl_estimator", ("k1", "k2", "k3"))
        one_of(self, "kl_penalty", ("reward", "loss", "none"))
        require(self, "clip_ratio_low", 0 < self.clip_ratio_low < 1, "must be in (0, 1)")
        require(self, "clip_ratio_high", self.clip_ratio_high > 0, "must be > 0")
        require(self, "value_clip", self.value_clip is None or self.value_clip > 0, "must be > 0 or null")
        one_of(self, "loss_aggregation", LOSS_AGGREGATIONS)
        require(self, "lambda_lr", self.lambda_lr > 0, "must be > 0")
        require(self, "lambda_init", self.lambda_init > 0, "must be > 0 (the multiplier is log-parameterised)")
        one_of(self, "policy_loss", ("ppo", "gspo"))
        at_least(self, 1, "max_sampling_rounds")
        at_least(self, 0, "overlong_buffer", "overlong_penalty", "max_staleness")
        one_of(self, "off_policy_correction", ("truncated", "masked"))
        require(self, "importance_cap", self.importance_cap > 1, "must be > 1")
        rule = f"dynamic sampling filters groups of samples; use {listed(GROUP_ALGORITHMS)}"
        require(self, "dynamic_sampling", not self.dynamic_sampling or self.name in GROUP_ALGORITHMS, rule)
