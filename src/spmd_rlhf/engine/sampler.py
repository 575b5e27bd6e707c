"""Next-token choice from last-position logits: greedy, temperature, top-k, top-p, per-request seeds.

The returned log-prob of a sampled token is log softmax(logits / T) at that token (T = 1 for greedy), before top-k /
top-p filtering: the same quantity the trainer's ``compute_log_probs`` computes at that temperature, so rollout and
training log-probs agree without correction.
"""

from __future__ import annotations

import torch

from .sequence import SamplingParams


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` [rows, vocab] with tokens outside the top-k / top-p sets set to -inf (the best token always stays)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __init__(self, *, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        """Used by requests without their own seed."""

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> tuple[list[int], list[float]]:
        """One token and its log-prob per row of ``logits`` [rows, vocab]."""
        logits = logits.float()
        temperatures = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        scaled = logits / temperatures[:, None]
        log_probs = scaled.log_softmax(dim=-1)
        tokens = scaled.argmax(dim=-1).tolist()
        sampled = [row for row, row_params in enumerate(params) if not row_params.greedy]
        if sampled:
            filtered = torch.cat([
                filter_logits(scaled[row : row + 1], top_k=params[row].top_k, top_p=params[row].top_p) for row in sampled
            ])
            # One copy to the host for all rows: the per-request generators are CPU generators, so a seed gives the
            # same tokens on any device.
            probabilities = filtered.softmax(dim=-1).cpu()
            for probability_row, row in zip(probabilities, sampled):
                tokens[row] = int(torch.multinomial(probability_row, 1, generator=generators[row] or self._shared))
        chosen = log_probs.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1)
        return tokens, chosen.tolist()
