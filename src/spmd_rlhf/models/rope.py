"""Rotary position embeddings: inverse frequencies (default, linear, llama3 scaling) and their application."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(
    *, head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device | None = None
) -> torch.Tensor:
    """``inv_freq[i] = theta ** (-2i / head_dim)``, then rescaled as the config's ``rope_scaling`` asks.

    llama3: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
    below ``.../high_freq_factor`` kept, and those in between interpolated smoothly (Llama 3.1's long-context recipe).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low_factor, high_factor = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original_context / low_factor, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= original_context / high_factor) & (wavelength <= original_context / low_factor)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns position ids into (cos, sin) tables, computed in float32 and cast to the activations' dtype."""

    def __init__(self, *, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        if not self.inv_freq.is_meta:  # on the meta device, ``DecoderLM.reset_buffers`` fills it once materialised
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` in float32 on its current device (after meta-device construction, ``to_empty``, or a
        model-wide ``.to(bfloat16)`` that would otherwise round the frequencies)."""
        self.inv_freq = rope_inverse_frequencies(
            head_dim=self.head_dim, theta=self.theta, scaling=self.scaling, device=self.inv_freq.device
        ).float()

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, seq, heads, head_dim]`` by tables of shape ``[batch, seq, head_dim]``."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
