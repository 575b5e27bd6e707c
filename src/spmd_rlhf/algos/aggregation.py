"""Per-token losses to one number, normalised over the *global* batch so results do not depend on how it is split.

A mini-batch is cut into DP shards and micro-batches. Each micro-batch's loss is its share of the whole mini-batch's
loss (its sum divided by a denominator counted over the whole mini-batch on all DP ranks), so summing the
micro-batch losses, and summing gradients over DP ranks, gives exactly the loss of the unsplit mini-batch.

Modes, for a per-token loss l[i, t], response mask m[i, t], N sequences, L = a fixed length:

- ``token_mean``:               Σ_i Σ_t m·l / Σ_i Σ_t m
- ``seq_mean_token_sum``:       (1/N) Σ_i Σ_t m·l
- ``seq_mean_token_mean``:      (1/N) Σ_i (Σ_t m·l / Σ_t m)
- ``seq_mean_token_sum_norm``:  Σ_i Σ_t m·l / (N · L)        (Dr. GRPO: no length bias)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class Denominators:
    """Counts over the whole mini-batch (all micro-batches, all DP ranks)."""

    tokens: float
    sequences: float
    max_length: float = 1.0
    """L of ``seq_mean_token_sum_norm``: the configured maximum response length."""

    @classmethod
    def local(cls, mask: torch.Tensor, max_length: int | None = None) -> Denominators:
        """Counts of this batch alone (for an unsplit batch, or as the piece to all-reduce)."""
        return cls(float(mask.sum()), float(mask.shape[0]), float(max_length or mask.shape[1]))


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, denominators: Denominators | None = None
) -> torch.Tensor:
    """This batch's share of the aggregated loss; ``denominators`` default to this batch's own counts."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGGREGATIONS)}")
    counts = denominators or Denominators.local(mask)
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        return (loss * mask).sum() / max(counts.tokens, 1.0)
    if mode == "seq_mean_token_sum":
        return (loss * mask).sum() / max(counts.sequences, 1.0)
    if mode == "seq_mean_token_mean":
        per_sequence = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_sequence.sum() / max(counts.sequences, 1.0)
    return (loss * mask).sum() / max(counts.sequences * counts.max_length, 1.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
