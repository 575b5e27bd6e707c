"""``algorithm``: the RL algorithm, its advantage estimator, loss, KL and off-policy settings."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from spmd_rlhf.config import dataflow
from spmd_rlhf.config.dataflow import GROUP_ALGORITHMS
from spmd_rlhf.config.errors import at_least, listed, one_of, require

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""The modes of ``spmd_rlhf.algos.aggregate`` (a test keeps the two lists equal)."""


ALGORITHMS = tuple(dataflow.ALGORITHMS)
"""Every ``algorithm.name``: the members of every family's dataflow."""

POLICY_LOSSES = ("ppo", "gspo", "cispo", "gmpo", "sapo")
ROUTER_REPLAY_MODES = ("off", "rollout", "recompute")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_PRESETS: dict[str, dict] = {
    "disabled": {"is_level": None, "rs_level": None},
    "decoupled_token_is": {"is_level": "token", "is_threshold": 2.0, "rs_level": None},
    "decoupled_seq_is": {"is_level": "sequence", "is_threshold": 2.0, "rs_level": None},
    "decoupled_seq_is_rs": {
        "is_level": "sequence",
        "is_threshold": 2.0,
        "rs_level": "sequence",
        "rs_threshold": 2.0,
        "rs_threshold_lower": 0.5,
    },
    "decoupled_geo_rs": {
        "is_level": None,
        "rs_level": "geometric",
        "rs_threshold": 1.001,
        "rs_threshold_lower": 0.999,
        "veto_threshold": 1e-4,
    },
    "token_is_rs": {
        "is_level": "token",
        "is_threshold": 2.0,
        "rs_level": "token",
        "rs_threshold": 2.0,
        "rs_threshold_lower": 0.5,
    },
    "token_rs": {"is_level": None, "rs_level": "token", "rs_threshold": 2.0, "rs_threshold_lower": 0.5},
    "seq_rs": {"is_level": None, "rs_level": "sequence", "rs_threshold": 2.0, "rs_threshold_lower": 0.5},
    "icepop": {"is_level": None, "rs_level": "token", "rs_threshold": 5.0, "rs_threshold_lower": 0.5},
}
"""``algorithm.correction.preset``: verl's decoupled presets (``RolloutCorrectionConfig.<name>()``), the combinations
its guide lists without a method (``token_is_rs``, ``token_rs``, ``seq_rs``), and ICEPOP's token mask outside
[0.5, 5]. Keys a preset does not name keep their defaults."""
UNSUPPORTED_PRESETS = {
    "ppo_is_bypass": "verl's bypass mode is rollout.recompute_log_probs=false here (PPO's ratio is then taken against "
    "the engine's log-probs and there is nothing to correct); leave algorithm.correction.preset null",
    "pg_is": "it trains with verl's policy-gradient loss without clipping, which this project does not have; use "
    "decoupled_seq_is, or algorithm.policy_loss=cispo (a clipped IS weight that keeps every token's gradient)",
    "pg_rs": "it trains with verl's policy-gradient loss without clipping, which this project does not have; use "
    "decoupled_geo_rs",
}


@dataclass
class CorrectionConfig:
    """Rollout correction (``algos.off_policy``): weights and rejection for the gap between the engine that sampled a
    response (behaviour log-probs) and the trainer's recomputed log-probs (pi_old), at any staleness. Applied
    whenever the log-probs are recomputed (rollout.recompute_log_probs: derived true at max_staleness >= 1 or with a
    preset other than disabled); verl's algorithm.rollout_correction, key for key."""

    preset: str | None = None
    """A named combination that sets the keys below (a key also set to another non-default value is refused):
    decoupled_token_is, decoupled_seq_is, decoupled_seq_is_rs, decoupled_geo_rs, token_is_rs, token_rs, seq_rs,
    icepop or disabled. null: the keys as given."""
    is_level: str | None = "token"
    """Importance weights (verl's rollout_is): token (w_t = pi_old/mu per token), sequence (their product),
    geometric (their geometric mean), or null (no weights)."""
    is_threshold: float = 2.0
    """Truncation of the importance weights: min(w, is_threshold) (> 1; verl's rollout_is_threshold)."""
    rs_level: str | None = None
    """Rejection (verl's rollout_rs): tokens (token) or whole responses (sequence, geometric) whose ratio leaves
    [rs_threshold_lower, rs_threshold] leave the loss and its token count; null: none."""
    rs_threshold: float | None = None
    """Upper bound of the rejection (> 1); null: is_threshold."""
    rs_threshold_lower: float | None = None
    """Lower bound of the rejection (in [0, 1)); null: 1 / rs_threshold."""
    veto_threshold: float | None = None
    """A response with any token whose ratio is below this (in (0, 1), e.g. 1e-4) is rejected whole (verl's
    rollout_token_veto_threshold); null: no veto."""

    def __post_init__(self) -> None:
        if self.preset in UNSUPPORTED_PRESETS:
            require(self, "preset", False, UNSUPPORTED_PRESETS[self.preset])
        names = ", ".join(CORRECTION_PRESETS)
        require(self, "preset", self.preset is None or self.preset in CORRECTION_PRESETS, f"must be {names} or null")
        if self.preset is not None:
            defaults = {item.name: item.default for item in fields(CorrectionConfig)}
            for key, value in CORRECTION_PRESETS[self.preset].items():
                current = getattr(self, key)
                rule = f"preset {self.preset} sets it to {value}; leave it unset or set preset=null"
                require(self, key, current in (defaults[key], value), rule)
                setattr(self, key, value)
        for key in ("is_level", "rs_level"):
            level = getattr(self, key)
            require(
                self, key, level is None or level in CORRECTION_LEVELS, "must be token, sequence, geometric or null"
            )
        require(self, "is_threshold", self.is_threshold > 1, "must be > 1")
        require(self, "rs_threshold", self.rs_threshold is None or self.rs_threshold > 1, "must be > 1 or null")
        lower = self.rs_threshold_lower
        require(self, "rs_threshold_lower", lower is None or 0 <= lower < 1, "must be in [0, 1) or null")
        veto = self.veto_threshold
        require(self, "veto_threshold", veto is None or 0 < veto < 1, "must be in (0, 1) or null")

    @property
    def rs_upper(self) -> float:
        return self.is_threshold if self.rs_threshold is None else self.rs_threshold

    @property
    def rs_lower(self) -> float:
        return 1.0 / self.rs_upper if self.rs_threshold_lower is None else self.rs_threshold_lower


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
    """The policy loss: ppo (clipped ratio per token), gspo (clipped ratio per sequence, Zheng et al. 2025; use small
    clip ratios such as 3e-4 / 4e-4), cispo (the clipped ratio as a constant weight of the policy gradient, MiniMax-M1;
    every token keeps its gradient), gmpo (geometric mean of the token ratios, clipped in log space, Zhao et al. 2025;
    clip ratios such as 0.4) or sapo (a smooth gate in place of the clip, Gao et al. 2025: sapo_tau_positive and
    sapo_tau_negative). clip_ratio_low / clip_ratio_high bound the ratio of ppo, gspo and cispo, and the log-ratio of
    gmpo."""
    sapo_tau_positive: float = 1.0
    """SAPO: temperature of the gate for tokens with a positive advantage (> 0)."""
    sapo_tau_negative: float = 1.05
    """SAPO: temperature of the gate for tokens with a zero or negative advantage (> 0)."""
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
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Rollout correction of the engine-vs-trainer gap and of stale samples (docs/async.md)."""
    router_replay: str = "off"
    """Mixture-of-experts models: which experts the training forward routes each token to. off: the router's own
    top-k; rollout (R3): the experts the generation engine chose for it, recorded per token and MoE layer; recompute
    (R2): the experts the old policy chose in the log-prob recompute (needs rollout.recompute_log_probs=true). The
    router's weights are recomputed at the replayed experts, so it still trains (docs/models.md)."""

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
        one_of(self, "policy_loss", POLICY_LOSSES)
        for key in ("sapo_tau_positive", "sapo_tau_negative"):
            require(self, key, getattr(self, key) > 0, "must be > 0")
        at_least(self, 1, "max_sampling_rounds")
        at_least(self, 0, "overlong_buffer", "overlong_penalty", "max_staleness")
        one_of(self, "router_replay", ROUTER_REPLAY_MODES)
        rule = f"dynamic sampling filters groups of samples; use {listed(GROUP_ALGORITHMS)}"
        require(self, "dynamic_sampling", not self.dynamic_sampling or self.name in GROUP_ALGORITHMS, rule)
