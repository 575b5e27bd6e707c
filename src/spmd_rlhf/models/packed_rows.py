"""Where each token of a batch sits: the offsets of sequences packed into one row, their positions, and the index of
each sequence's last real token, for packed rows (``cu_seqlens``), padded rows (``attention_mask``, left or right)
and plain ones. The decoder reads them; they know nothing of the model."""

from __future__ import annotations

import torch


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Sequence offsets of a packed row ``[1, total]`` whose position ids restart at 0; None if there is one
    sequence."""
    if position_ids.shape[0] != 1:
        return None
    starts = (position_ids[0] == 0).nonzero().squeeze(1)
    if starts.numel() <= 1 or int(starts[0]) != 0:
        return None
    total = torch.tensor([position_ids.shape[1]], device=position_ids.device)
    return torch.cat([starts, total]).to(torch.int32)


def packed_offsets(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor | None:
    """The given ``cu_seqlens``, else the offsets implied by restarting position ids of an unmasked row."""
    if cu_seqlens is None and attention_mask is None and position_ids is not None:
        return cu_seqlens_from_position_ids(position_ids)
    return cu_seqlens


def default_position_ids(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Positions counting real tokens only: 0.. per row, restarting per packed sequence, skipping left padding."""
    batch_size, seq_len = input_ids.shape[:2]
    if cu_seqlens is not None:
        positions = torch.arange(seq_len, device=input_ids.device)
        starts = cu_seqlens.to(input_ids.device)[
            torch.bucketize(positions, cu_seqlens[1:].to(input_ids.device), right=True)
        ]
        return (positions - starts)[None]
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.arange(seq_len, device=input_ids.device).expand(batch_size, seq_len)


def last_token_index(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """Flat index of each sequence's last real token (rightmost mask position, so left and right padding both work)."""
    batch_size, seq_len = input_ids.shape[:2]
    if cu_seqlens is not None:
        return cu_seqlens[1:].to(input_ids.device).long() - 1
    if attention_mask is None:
        last = torch.full((batch_size,), seq_len - 1, device=input_ids.device)
    else:
        positions = torch.arange(seq_len, device=input_ids.device)
        last = (positions * attention_mask.to(positions.dtype)).argmax(-1)
    return torch.arange(batch_size, device=input_ids.device) * seq_len + last
