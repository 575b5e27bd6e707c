"""The tensor-parallel split of a decoder layer's linear layers, as data: ``parallelize`` applies it, and LoRA
adapters (``models.lora``) split the same way, so both read it from here."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

DECODER_LAYER_PLAN: dict[str, ParallelStyle] = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}
"""The linear layers of every decoder layer and their TP split (LoRA adapters split the same way, ``models.lora``)."""
