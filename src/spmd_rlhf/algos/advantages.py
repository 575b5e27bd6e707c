"""Advantage estimators: pure functions on ``[batch, response_length]`` tensors with a response mask.

Rewards are per token: a sequence-level score sits on the last response token (``scores_to_token_rewards``) and a
per-token KL penalty, if any, is subtracted everywhere (``kl.apply_kl_penalty``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r[i, t] = scores[i] at the last response token of row i, 0 elsewhere."""
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    last = (mask.long().cumsum(dim=1) * mask.long()).argmax(dim=1)
    has_tokens = mask.any(dim=1)
    rewards[has_tokens, last[has_tokens]] = scores[has_tokens]
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); returns (advantages, returns).

    δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γλ·A_{t+1},   R_t = A_t + V_t,
    where t+1 is the next *unmasked* token (masked positions are skipped; after the last one V = A = 0).
    Advantages and returns are 0 on masked positions.
    """
    mask = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        keep = mask[:, t]
        advantages[:, t] = advantage * keep
        next_value = keep * values[:, t] + (1 - keep) * next_value
        next_advantage = keep * advantage + (1 - keep) * next_advantage
    returns = (advantages + values) * mask
    return advantages, returns


def whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x − mean) / std over the masked entries (mean kept when ``shift_mean`` is False); 0 on masked positions.

    When the batch is split over data-parallel ranks, ``sum_over_ranks`` (e.g. an all-reduce over the DP group) makes
    mean and variance those of the whole batch, so the result does not depend on the split.
    """
    mask_f = mask.to(values.dtype)
    total = sum_over_ranks or (lambda tensor: tensor)
    sums = total(torch.stack([(values * mask_f).sum(), mask_f.sum()]))
    mean = sums[0] / sums[1].clamp(min=1.0)
    variance = total(((values - mean) ** 2 * mask_f).sum()) / sums[1].clamp(min=1.0)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask_f


def group_advantages(
    scores: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): A_i = (s_i − mean_g(s)) / (std_g(s) + ε) within each group of ``group_size``
    consecutive rows (the n samples of one prompt); without ``normalize_std``, A_i = s_i − mean_g(s) (Dr. GRPO).
    std is the unbiased sample standard deviation; a group of one has advantage 0."""
    if scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not divide into groups of {group_size}")
    grouped = scores.reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def broadcast_to_tokens(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x[i] on every response token of row i, 0 on masked positions."""
    return sequence_values[:, None].to(torch.float32) * mask.to(torch.float32)


def _check_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not divide into groups of {group_size}")
    return scores.reshape(-1, group_size)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each sample's baseline is the mean of the *other* samples of its prompt,
    A_i = s_i − (Σ_g s − s_i) / (n − 1) = n/(n−1) · (s_i − mean_g(s)). Needs n ≥ 2."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt (rollout.n >= 2)")
    grouped = _check_groups(scores, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(-1)


def remax_advantages(scores: torch.Tensor, baseline_scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """ReMax (Li et al. 2023): the baseline of every sample of a prompt is the reward of that prompt's greedy
    response, A_i = s_i − s_greedy(prompt(i)); ``baseline_scores`` has one entry per prompt."""
    grouped = _check_groups(scores, group_size)
    if baseline_scores.shape[0] != grouped.shape[0]:
        raise ValueError(f"{baseline_scores.shape[0]} baseline scores for {grouped.shape[0]} prompts")
    return (grouped - baseline_scores[:, None].to(grouped.dtype)).reshape(-1)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1} (REINFORCE's return-to-go) over each row's response tokens; 0 on masked positions
    (responses are right-padded, so the recursion simply carries 0 through the padding)."""
    mask = mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] * mask[:, t] + gamma * running
        returns[:, t] = running * mask[:, t]
    return returns


def groups_with_signal(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for each prompt whose samples' scores are not all equal (a group with
    equal scores has zero group-relative advantage and contributes no gradient)."""
    grouped = _check_groups(scores, group_size)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) > 0


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment added to a response's score: 0 up to ``max_length − buffer`` tokens, then
    falling linearly to ``−factor`` at ``max_length``: ``−factor · (L − (max_length − buffer)) / buffer``."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer={buffer} must be in (0, max_length={max_length}]")
    excess = (lengths.to(torch.float32) - (max_length - buffer)).clamp(min=0, max=buffer)
    return -factor * excess / buffer
