"""The token budget of a role's micro-batches when ``<role>.max_tokens_per_micro_batch=0`` (the default): on GPU,
derived for each pass from the memory the device has free and what one token of that pass holds, so that a
mini-batch runs as a few large micro-batches instead of many of ``micro_batch_size`` rows; elsewhere (CPU, where
memory is plentiful and a big pass is no faster) ``micro_batch_size`` rows, as with null.

What a token holds (``bytes_per_token``): in training, every layer's activations kept for the backward
(``layer_activation_elements``, counted from this decoder's own ops: an H200 run with the mapper's 17 h per layer,
Korthikanti et al.'s figure for a 4 h MLP, ran out of memory at Qwen2.5-1.5B's 5.8 h MLP; with activation
checkpointing each layer's input and one layer's whole set) and, at a response position, its logits and their
gradient over the rank's vocabulary slice; in a forward-only pass one layer's activations and the logits. The
budget is ``TOKEN_BUDGET_HEADROOM`` of the free bytes (the caching allocator's reusable bytes counted as free) over
that: the rest covers FSDP's gathered units, the log-prob path's float32 chunks and fragmentation. A budget that
cannot hold the longest row falls back to row micro-batches (that pass's memory is then what ``micro_batch_size``
makes it, as before).
"""

from __future__ import annotations

import torch

from spmd_rlhf.models.args import DecoderArgs

TOKEN_BUDGET_HEADROOM = 0.6
"""Share of the free device memory a derived budget plans to fill with one micro-batch's per-token bytes."""


def layer_activation_elements(args: DecoderArgs) -> int:
    """Elements one token keeps for the backward in one decoder layer of this decoder, as built: each RMSNorm's input
    and its float32 copy (3 h each), the normed input, q, k and v, their rotated copies, the attention output and
    the residual (about 5 h + 3 kv), and the MLP's gate, up, activation and product (4 I; an MoE layer's routed
    copies, k of them, each of the expert width)."""
    return activation_elements(**_widths(args))


def _widths(args: DecoderArgs) -> dict[str, int]:
    """The widths the per-token counts take: hidden, key/value and a token's MLP (an MoE layer's k expert widths)."""
    moe = args.moe
    width = moe.num_experts_per_tok * moe.moe_intermediate_size if moe else args.intermediate_size
    return {"hidden": args.hidden_size, "kv_width": args.num_kv_heads * args.head_dim, "mlp_width": width}


def activation_elements(*, hidden: int, kv_width: int, mlp_width: int) -> int:
    """``layer_activation_elements`` from the widths alone (the mapper's ``ModelShape`` has no ``DecoderArgs``):
    ``11 hidden + 3 kv_width + 4 mlp_width``, ``mlp_width`` a token's MLP width (an MoE layer's k expert widths)."""
    return 11 * hidden + 3 * kv_width + 4 * mlp_width


REPLICATED_HIDDENS = 8
"""Of ``activation_elements``, the hidden-wide ones every TP rank keeps whole unless sequence parallelism splits the
row: each RMSNorm's input and float32 copy (3 h each), the normed input and the residual (h each); q, its rotated
copy and the attention output (3 h), k and v (3 kv) and the MLP's (4 I) are split over tp."""

REPLICATED_SELECTIVE_HIDDENS = 3
"""Of ``selective_checkpoint_elements``, the ones every TP rank keeps whole without sequence parallelism: the block's
input and the output and down projections' summed outputs."""


def tp_rank_elements(total: float, replicated: float, *, tp: int, sequence_parallel: bool) -> float:
    """What one rank of ``tp`` keeps of ``total`` per-token elements of which ``replicated`` are whole on every TP
    rank unless ``sequence_parallel`` splits them too."""
    return (total - replicated) / tp + replicated / (tp if sequence_parallel else 1)


def selective_checkpoint_elements(*, hidden: int, kv_width: int, mlp_width: int) -> int:
    """Elements one token keeps in one layer under ``model.checkpoint_policy=selective`` (``parallelize.SAVED_OPS``):
    the block's input (h) and the outputs of its matmuls and attention, q (h), k and v (2 kv), the attention output
    (h), the output projection (h), gate and up (2 I) and down (h): ``5 hidden + 2 kv_width + 2 mlp_width``."""
    return 5 * hidden + 2 * kv_width + 2 * mlp_width


def bytes_per_token(
    args: DecoderArgs,
    *,
    tp: int,
    pp: int,
    dtype_bytes: int,
    train: bool,
    activation_checkpointing: bool,
    checkpoint_policy: str = "full",
    sequence_parallel: bool = False,
) -> float:
    """Bytes one token of a micro-batch holds on one rank of a ``tp`` x ``pp`` layout (module docstring); the logits
    are counted at every token, an upper bound for the response positions that have them. Under context parallelism
    a token is one of a rank's chunk of the row, and each rank runs the head on its own chunk
    (``training.context_parallel``), so a token's bytes are the same. Without ``sequence_parallel`` the residual
    stream's and the norms' activations are whole on every TP rank (``REPLICATED_HIDDENS``)."""
    hidden = args.hidden_size
    split = {"tp": tp, "sequence_parallel": sequence_parallel}
    layer = tp_rank_elements(layer_activation_elements(args), REPLICATED_HIDDENS * hidden, **split) * dtype_bytes
    layers = args.num_layers / pp
    if not train:
        kept = layer
    elif activation_checkpointing and checkpoint_policy == "selective":
        selective = selective_checkpoint_elements(**_widths(args))
        kept = tp_rank_elements(selective, REPLICATED_SELECTIVE_HIDDENS * hidden, **split) * dtype_bytes * layers
        kept += layer
    elif activation_checkpointing:
        kept = tp_rank_elements(2 * hidden, 2 * hidden, **split) * dtype_bytes * layers + layer
    else:
        kept = layer * layers
    logits = args.vocab_size / tp * dtype_bytes * (2 if train else 1)
    return kept + logits


def derived_token_budget(*, free_bytes: float, per_token: float, longest: int) -> int | None:
    """``TOKEN_BUDGET_HEADROOM`` of ``free_bytes`` in tokens of ``per_token`` bytes; None when that cannot hold a
    row of ``longest`` tokens."""
    budget = int(free_bytes * TOKEN_BUDGET_HEADROOM // per_token)
    return budget if budget >= longest else None


def free_device_bytes(device: torch.device) -> int:
    """What ``device`` can still allocate: the driver's free bytes plus this process's cached, unallocated ones."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
