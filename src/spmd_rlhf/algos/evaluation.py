"""Evaluation statistics over sampled responses."""

from __future__ import annotations

import torch


def pass_at_k(passed: torch.Tensor, k: int) -> torch.Tensor:
    """Unbiased pass@k per prompt (Chen et al. 2021) from ``passed`` ``[prompts, n]`` with n >= k samples each:
    1 − C(n − c, k) / C(n, k), c = passing samples."""
    n = passed.shape[1]
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    failures = n - passed.sum(dim=1).double()
    # C(n - c, k) / C(n, k) = prod_{i=0}^{k-1} (n - c - i) / (n - i), 0 once fewer than k samples failed.
    ratio = torch.ones_like(failures)
    for i in range(k):
        ratio = ratio * ((failures - i).clamp(min=0) / (n - i))
    return 1.0 - ratio
