"""Advantages of a rollout shard, for every estimator the recipes use, computed where the rows already are.

``rollout_advantages`` turns the fields of one DP shard (responses, scores or costs, log-probs, values) into
per-token advantages with the ``algos`` functions; statistics over the whole batch (whitening, metrics) come from
reductions over the DP group, so the result does not depend on the DP split.

| estimator               | advantage                                                                 |
| ----------------------- | ------------------------------------------------------------------------- |
| gae                     | GAE on per-token rewards and critic values (PPO, Safe-RLHF)               |
| grpo                    | (R − mean_g R) / std_g R per prompt (std off: Dr. GRPO)                   |
| rloo                    | R − mean of the prompt's other samples                                    |
| remax                   | R − the reward of the prompt's greedy response                            |
| reinforce_pp            | return-to-go of per-token rewards (KL penalty included), whitened         |
| reinforce_pp_baseline   | the same after subtracting each prompt's mean score                       |
"""

from __future__ import annotations

import torch

from spmd_rlhf.algos import (
    apply_kl_penalty,
    broadcast_to_tokens,
    discounted_returns,
    gae,
    group_advantages,
    kl_estimate,
    overlong_penalty,
    remax_advantages,
    rloo_advantages,
    scores_to_token_rewards,
    whiten,
)
from spmd_rlhf.config import AlgorithmConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.training.reducer import DPReducer

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline")
SOURCES = {"reward": ("scores", "values", ""), "cost": ("costs", "cost_values", "cost_")}
"""What is being estimated -> (score key, value key, prefix of the output keys)."""


def old_log_probs(batch: Batch) -> torch.Tensor:
    """π_old of the PPO ratio: recomputed ``old_log_probs`` when present, else the engine's ``rollout_log_probs``."""
    return batch["old_log_probs"] if "old_log_probs" in batch.tensors else batch["rollout_log_probs"]


def behaviour_log_probs(batch: Batch) -> torch.Tensor:
    """μ of the importance correction: the engine's ``sampling_log_probs`` (under the top-k / top-p distribution each
    token was drawn from) when present, else its ``rollout_log_probs`` (the same wherever nothing was filtered)."""
    return batch["sampling_log_probs"] if "sampling_log_probs" in batch.tensors else batch["rollout_log_probs"]


def rollout_advantages(
    data: Batch,
    *,
    estimator: str,
    algorithm: AlgorithmConfig,
    kl_coef: float,
    reducer: DPReducer,
    max_response_length: int,
    source: str = "reward",
    baseline_scores: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """(tensors, metrics) for one DP shard: ``advantages`` (``cost_advantages`` for ``source="cost"``), and
    ``returns`` for GAE. The KL penalty and DAPO's overlong shaping apply to the reward only."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"advantage estimator {estimator!r} is unknown; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    if source not in SOURCES:
        raise ValueError(f"advantage source {source!r} is unknown; choose reward or cost")
    score_key, value_key, prefix = SOURCES[source]
    mask = data["response_mask"]
    scores = data[score_key].float()
    if source == "reward" and "env_reward" in data.tensors:
        scores = scores + data["env_reward"].float()  # a multi-turn environment's own rewards (rollout.environment)
    tensors: dict[str, torch.Tensor] = {}
    means: dict[str, tuple[float, float]] = {}
    """Metric -> (this shard's sum, count), averaged over DP in one collective at the end."""
    if source == "reward" and algorithm.overlong_buffer:
        penalty = overlong_penalty(
            mask.sum(dim=1),
            max_length=max_response_length,
            buffer=algorithm.overlong_buffer,
            factor=algorithm.overlong_penalty,
        )
        scores = scores + penalty
        means["reward/overlong_penalty"] = (float(penalty.double().sum()), float(len(scores)))
    if estimator == "reinforce_pp_baseline":
        scores = group_advantages(scores, data.group_size, normalize_std=False)
    token_rewards = scores_to_token_rewards(scores, mask)
    if source == "reward" and "ref_log_probs" in data.tensors:
        kl = kl_estimate(old_log_probs(data), data["ref_log_probs"], algorithm.kl_estimator)
        per_sequence_kl = (kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        means["kl/mean"] = (float(per_sequence_kl.double().sum()), float(len(data)))
        if algorithm.kl_penalty == "reward":
            token_rewards = apply_kl_penalty(token_rewards, kl, kl_coef, mask)
    if estimator == "gae":
        advantages, returns = gae(
            token_rewards, data[value_key].float(), mask, gamma=algorithm.gamma, lam=algorithm.lam
        )
        tensors[f"{prefix}returns"] = returns
        if algorithm.normalize_advantages:
            advantages = whiten(advantages, mask, sum_over_ranks=reducer.sum)
    elif estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        returns = discounted_returns(token_rewards, mask, gamma=algorithm.gamma)
        advantages = whiten(returns, mask, sum_over_ranks=reducer.sum)
    else:
        sequence_rewards = (token_rewards * mask).sum(dim=1)
        if estimator == "grpo":
            advantages = group_advantages(
                sequence_rewards, data.group_size, normalize_std=algorithm.normalize_advantages
            )
        elif estimator == "rloo":
            advantages = rloo_advantages(sequence_rewards, data.group_size)
        else:
            if baseline_scores is None:
                raise ValueError(
                    "the remax estimator needs the greedy responses' scores (compute_advantages(baseline=...))"
                )
            advantages = remax_advantages(sequence_rewards, baseline_scores.float(), data.group_size)
        advantages = broadcast_to_tokens(advantages, mask)
    tensors[f"{prefix}advantages"] = advantages
    mask_f = mask.double()
    means[f"{prefix}advantages/mean"] = (float((advantages.double() * mask_f).sum()), float(mask_f.sum()))
    totals, _ = reducer.totals([value for pair in means.values() for value in pair])
    metrics = {name: totals[2 * index] / max(totals[2 * index + 1], 1.0) for index, name in enumerate(means)}
    return tensors, metrics
