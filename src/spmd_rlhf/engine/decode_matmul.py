"""``rollout.decode_matmul``: which kernels run the generation copy's projections at a few rows.

``use_skinny_linear`` points every decoder block's projections (the merged q/k/v and gate/up, o and down; not the
LM head, which cuBLAS already runs near the copy bandwidth, nor MoE experts) at ``torch.ops.spmd_rlhf.skinny_linear``,
which takes up to its tiling's ``max_rows`` rows through ``spmd_rlhf.kernels.skinny_linear``'s Triton kernels:
batch-1 decode steps use it (``DEFAULT_TILINGS``); prefill and larger batches call ``F.linear`` itself, as the block
did before, which a compiled block traces as its own. In a dense block with merged projections (the generation
copy's) it also moves the elementwise work between the matmuls into them: at that many rows, the block runs as

    h, qkv = skinny_residual_norm_linear(x, pending, input norm, q/k/v)   # the previous block's residual add too
    (attention)
    h, gate_up = skinny_residual_norm_linear(h, o_proj(out), post-attention norm, gate/up)
    pending = skinny_silu_mul_linear(gate_up, down)

four kernels (and down's split sum) where the compiled block ran seven; more rows take the block's own pieces. The
operators are opaque to TorchDynamo, so compiled blocks (``rollout.compile``) call them between what is left to fuse,
and decode graphs capture them. A TP replica on local shards (``models.local_tensor_parallel.run_locally``) takes
them too, on its shards: the merged matmuls hold local rows already, o and down (row-parallel) compute this rank's
partial product through the operator and then sum it over the TP group (``summed_over_ranks``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from spmd_rlhf.kernels import skinny_operators  # noqa: F401  (registers torch.ops.spmd_rlhf.skinny_*)
from spmd_rlhf.kernels.skinny_linear import SkinnyConfig
from spmd_rlhf.kernels.triton_support import use_triton
from spmd_rlhf.models.decoder import DecoderLayer, DecoderLM
from spmd_rlhf.models.local_tensor_parallel import local_parameter, skinny_or_linear, summed_over_ranks
from spmd_rlhf.models.merged_linear import MergeableProjections
from spmd_rlhf.models.moe import SwiGLU

DECODE_MATMULS = ("auto", "torch", "triton")

PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj")}
"""A block's projections by the tiling they take, and the names of the linear layers each stands for unmerged;
anything else (``down_proj``, a layer of another name) takes ``down``'s."""

DEFAULT_TILINGS = {
    "qkv": SkinnyConfig(max_rows=1),
    "o": SkinnyConfig(block_out=4, max_rows=1),
    "gate_up": SkinnyConfig(num_warps=2, max_rows=1),
    "down": SkinnyConfig(num_warps=2, max_rows=1),
}
"""Each projection's tiling, from session 47's sweep on an H200 (``benchmarks/gpu_skinny_sweep.py``, one row; us
per call at the 1.5B and the 7B shape): q/k/v the reasoned defaults (5.65, 12.13: the best at 7B, 0.1 us off the
best at 1.5B); o four outputs per program (4.57, 9.85, against 4.77, 12.30 for the defaults); gate/up and down two
warps per program (19.73 and 11.97 at 1.5B, 71.65 and 39.82 at 7B, against 20.48, 14.35, 73.92, 52.47). One row
each: at two and four rows the kernels lost to cuBLAS (``SkinnyConfig.max_rows``)."""


def _skinny_linear(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's forward, or a merged one's matmul, through the operator at up to its tiling's rows; more rows
    (prefill, larger batches) ``F.linear`` itself, which a compiled block traces as its own (the operator's
    fallback would be opaque to Inductor)."""
    return skinny_or_linear(self, x, self.weight, self.bias)


def _takes(self: DecoderLayer, x: torch.Tensor) -> bool:
    """Whether the fused pieces run ``x`` (``[batch, seq, hidden]``): at most the tilings' ``max_rows`` tokens."""
    return x.shape[0] * x.shape[1] <= self.skinny_rows


def _tilings(config: SkinnyConfig | Mapping[str, SkinnyConfig]) -> dict[str, SkinnyConfig]:
    """Every projection's tiling: one for all, or one per ``PROJECTIONS`` name and ``down``."""
    if isinstance(config, SkinnyConfig):
        return dict.fromkeys((*PROJECTIONS, "down"), config)
    if set(config) != {*PROJECTIONS, "down"}:
        raise ValueError(f"decode tilings are one SkinnyConfig or one per {sorted({*PROJECTIONS, 'down'})}")
    return dict(config)


def _projection(name: str) -> str:
    """The tiling a linear layer named ``name`` (its attribute name in the block) takes."""
    return next((projection for projection, names in PROJECTIONS.items() if name in names), "down")


def _attention_inputs(self: DecoderLayer, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DecoderLayer.attention_inputs``: the input norm inside the q/k/v matmul."""
    if not _takes(self, x):
        return DecoderLayer.attention_inputs(self, x, rope)
    attention, norm = self.self_attn, self.input_layernorm
    merged = attention.merged
    qkv = torch.ops.spmd_rlhf.skinny_norm_linear(
        x, norm.weight, norm.eps, merged.weight, merged.bias, *merged.skinny_kernels
    )
    return attention.split_merged_queries_keys_values(qkv, rope)


def _residual_attention_inputs(
    self: DecoderLayer, x: torch.Tensor, pending: torch.Tensor, rope
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DecoderLayer.residual_attention_inputs``: the residual add and the input norm inside the q/k/v matmul."""
    if not _takes(self, x):
        return DecoderLayer.residual_attention_inputs(self, x, pending, rope)
    attention, norm = self.self_attn, self.input_layernorm
    merged = attention.merged
    x, qkv = torch.ops.spmd_rlhf.skinny_residual_norm_linear(
        x, pending, norm.weight, norm.eps, merged.weight, merged.bias, *merged.skinny_kernels
    )
    return (x, *attention.split_merged_queries_keys_values(qkv, rope))


def _attention_outputs_apart(
    self: DecoderLayer, x: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``DecoderLayer.attention_outputs_apart``: the residual add and the post-attention norm inside the gate/up
    matmul, the activation inside the down projection's."""
    if not _takes(self, x):
        return DecoderLayer.attention_outputs_apart(self, x, out)
    mlp, norm = self.mlp, self.post_attention_layernorm
    merged = mlp.merged
    x, gate_up = torch.ops.spmd_rlhf.skinny_residual_norm_linear(
        x, self.self_attn.output(out), norm.weight, norm.eps, merged.weight, merged.bias, *merged.skinny_kernels
    )
    down = mlp.down_proj
    if _on_local_shards(down):  # row-parallel: this rank's share of the product, then summed over the TP group
        partial = torch.ops.spmd_rlhf.skinny_silu_mul_linear(
            gate_up, local_parameter(down, "weight"), None, *down.skinny_kernels
        )
        return x, summed_over_ranks(down, partial)
    return x, torch.ops.spmd_rlhf.skinny_silu_mul_linear(gate_up, down.weight, down.bias, *down.skinny_kernels)


def _on_local_shards(linear: nn.Module) -> bool:
    """Whether ``linear`` computes on its local shards (``models.local_tensor_parallel.run_locally``)."""
    return getattr(linear, "local_shards", None) is not None


def _fusable(layer: DecoderLayer) -> bool:
    """A dense block whose q/k/v (without QK norms) and gate/up are merged: the fused pieces' shape."""
    attention, mlp = layer.self_attn, layer.mlp
    return (
        attention.merged is not None
        and not hasattr(attention, "q_norm")
        and isinstance(mlp, SwiGLU)
        and mlp.merged is not None
    )


def skinny_linear_unsupported(model: DecoderLM, *, backend: str = "auto") -> str | None:
    """Why ``use_skinny_linear`` cannot serve ``model`` with ``backend`` (a sentence), or None when it can."""
    weight = model.model.embed_tokens.weight
    if isinstance(weight, DTensor) and not model.local_tensor_parallel:
        return (
            "the model's tensor-parallel layers dispatch through DTensor; the kernels take a TP replica on local "
            "shards (models.local_tensor_parallel.run_locally)"
        )
    if not use_triton(weight.device, backend):
        return f"the Triton kernels need CUDA tensors and the triton package (the model is on {weight.device})"
    return None


def use_skinny_linear(
    model: DecoderLM, *, backend: str = "auto", config: SkinnyConfig | Mapping[str, SkinnyConfig] = DEFAULT_TILINGS
) -> tuple[int, int]:
    """Point ``model``'s decoder projections at the skinny-linear operators (in place, for good: the engine's model
    is a generation copy), and the pieces of its fusable blocks at the fused ones; returns ``(matmuls per block
    through the operator, blocks fused)``. ``backend``: the kernels' (``auto``; tests under Triton's interpreter pass
    ``triton``); ``config``: their tiling, one for every projection or one each (``DEFAULT_TILINGS``'s keys); a
    fused block takes the fewest ``max_rows`` of its tilings. Call before ``compile_around_attention``, which traces
    the forwards. Once per model: a second call with the same backend and tilings (a second engine on the model)
    changes nothing and returns the first one's counts (rebinding the pieces would drop their compiled wrappers)."""
    tilings = _tilings(config)
    applied = model.skinny_decode
    if applied is not None:
        if applied[0] != (backend, tilings):
            raise ValueError(
                "this model's projections already run the skinny-linear kernels with other tilings or another "
                "backend; load the model again to change them"
            )
        return applied[1]
    if model.model.carry_residuals:
        raise ValueError(
            "the model's blocks are compiled around attention already; call use_skinny_linear before "
            "compile_around_attention, which traces the pieces it points at the kernels"
        )
    # Every operator's last two arguments, and the most rows they take (``takes_rows``).
    kernels = {name: ((backend, tiling.as_tiling()), tiling.max_rows) for name, tiling in tilings.items()}
    rows = min(tiling.max_rows for tiling in tilings.values())
    per_block, fused = 0, 0
    for index, layer in enumerate(model.model.layers.values()):
        mergeable = [m for m in layer.modules() if isinstance(m, MergeableProjections) and m.merged is not None]
        inside_merged = {id(linear) for m in mergeable for linear in m.merged.linears}
        for m in mergeable:
            merged = m.merged
            merged.skinny_kernels, merged.skinny_rows = kernels["qkv" if m is layer.self_attn else "gate_up"]
            merged.matmul = types.MethodType(_skinny_linear, merged)
        linears = [
            (name, m) for name, m in layer.named_modules() if isinstance(m, nn.Linear) and id(m) not in inside_merged
        ]
        for name, linear in linears:
            linear.skinny_kernels, linear.skinny_rows = kernels[_projection(name.rsplit(".", 1)[-1])]
            if not _on_local_shards(linear):  # a TP layer's own local forward takes the operator (skinny_kernels)
                linear.forward = types.MethodType(_skinny_linear, linear)
        swapped = len(mergeable) + len(linears)
        per_block = swapped if index == 0 else min(per_block, swapped)
        if _fusable(layer):
            layer.skinny_rows = rows
            for name, piece in (
                ("attention_inputs", _attention_inputs),
                ("residual_attention_inputs", _residual_attention_inputs),
                ("attention_outputs_apart", _attention_outputs_apart),
            ):
                setattr(layer, name, types.MethodType(piece, layer))
            fused += 1
    model.skinny_decode = (backend, tilings), (per_block, fused)
    return per_block, fused


def apply_decode_matmul(
    model: DecoderLM, setting: str, *, config: SkinnyConfig | Mapping[str, SkinnyConfig] = DEFAULT_TILINGS
) -> str | None:
    """``rollout.decode_matmul``'s ``setting`` applied to ``model`` (``triton`` and ``auto``: ``use_skinny_linear``
    with ``config``, where ``skinny_linear_unsupported`` allows; ``torch``: nothing). Returns why ``triton`` could not
    be applied (the caller logs it once), else None: ``auto`` falls back to ``F.linear`` without a word."""
    if setting not in DECODE_MATMULS:
        raise ValueError(f"decode_matmul={setting!r} is unknown; choose one of {', '.join(DECODE_MATMULS)}")
    if setting == "torch":
        return None
    why = skinny_linear_unsupported(model)
    if why is None:
        use_skinny_linear(model, config=config)
    return why if setting == "triton" else None
