"""Sequence parallelism's row: under ``<role>.sequence_parallel`` each TP rank keeps ``1 / tp`` of a packed row's
tokens between the TP regions (``models.tp_plan``), so the row's length must be a multiple of tp. ``padded_row``
appends one padding sequence (token 0, positions from 0, its own entry in ``cu_seqlens``, so no real token attends to
it) and ``DecoderLM.hidden_states`` drops its hidden states again before the head. ``check_sequence_parallel``:
what it does not split yet."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spmd_rlhf.models.decoder import DecoderLM


def padded_row(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int | None,
    multiple: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int | None]:
    """``(input_ids, position_ids, cu_seqlens, max_seqlen)`` of a packed row ``[1, tokens]`` padded to a multiple of
    ``multiple`` tokens (unchanged where it is one already); a ``ValueError`` for padded rows (``attention_mask``) or
    a batch of several, which sequence parallelism does not split."""
    if input_ids.shape[0] != 1 or attention_mask is not None:
        raise ValueError(
            "sequence parallelism splits one packed row (input_ids [1, tokens] with cu_seqlens), not padded rows "
            f"{tuple(input_ids.shape)}; pack the sequences or set <role>.sequence_parallel=false"
        )
    tokens = input_ids.shape[1]
    padding = -tokens % multiple
    if padding == 0:
        return input_ids, position_ids, cu_seqlens, max_seqlen
    device = input_ids.device
    if cu_seqlens is None:  # one sequence
        cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([tokens + padding])])
    input_ids = torch.cat([input_ids, input_ids.new_zeros(1, padding)], dim=1)
    position_ids = torch.cat([position_ids, torch.arange(padding, device=position_ids.device)[None]], dim=1)
    return input_ids, position_ids, cu_seqlens, None if max_seqlen is None else max(max_seqlen, padding)


def check_sequence_parallel(model: DecoderLM, *, cp: bool, role: str) -> None:
    """Raise a ``ValueError`` naming the setting to change where ``<role>.sequence_parallel`` cannot split the row
    yet: mixture-of-experts layers (their experts' TP split needs every rank's tokens), a pipeline stage and context
    parallelism."""
    moe = model.args.moe
    cases = {
        "mixture-of-experts layers": moe is not None and bool(moe.layers),
        f"a pipeline stage ({role}.pp > 1)": model.model.embed_tokens is None or model.model.norm is None,
        f"context parallelism ({role}.cp > 1)": cp,
    }
    for what, present in cases.items():
        if present:
            raise ValueError(f"{role}.sequence_parallel does not split the row with {what} yet; set it to false")
