"""What ``rollout.compile`` compiles for generation: each decoder block around its attention call, and the draw of
the static decode step (``decode_graphs``), both before the decode graphs capture them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from spmd_rlhf.config.choices import COMPILE_SETTINGS
from spmd_rlhf.engine.sampler import draw_rows
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.moe import MoEBlock

logger = logging.getLogger(__name__)


def compile_backend(setting: str, *, graphs: bool) -> str | None:
    """The TorchDynamo backend ``compile_around_attention`` uses for ``rollout.compile``'s ``setting``, or None for
    eager layers: ``auto`` compiles where decode steps are captured into CUDA graphs (``graphs``; a TP replica's
    blocks included, their all-reduces traced as functional collectives), ``on`` everywhere (CPU included: Inductor
    then needs a C++ compiler), ``off`` never."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"rollout.compile={setting!r} is unknown; choose one of {', '.join(COMPILE_SETTINGS)}")
    return "inductor" if setting == "on" or (setting == "auto" and graphs) else None


def compile_around_attention(model: DecoderLM, *, backend: str = "inductor") -> None:
    """``torch.compile`` each decoder block of a generation model in two pieces, the block before its attention
    kernel call (input norm, q/k/v projections, QK norms, rotation: ``DecoderLayer.attention_inputs``) and after it
    (output projection, residuals, post-attention norm, MLP: ``attention_outputs_apart``), so Inductor fuses the casts,
    reductions and elementwise ops between the matmuls: on an H100 these were 1.5 of a batch-1 decode step's 3.3 ms
    of device time, about 34 kernels per layer (``docs/benchmarks.md``, session 37). The residual add after each
    block's MLP moves into the next block's first piece (``residual_attention_inputs``; ``Backbone.carry_residuals``)
    and the last one's into the final norm (``residual_norm``), where Inductor fuses it with the norm: one kernel
    per layer fewer, and the final norm one kernel where it was eight eager ones; the rotary tables are compiled
    too. The attention call between the pieces (writing the new K/V into the paged cache, reading the context)
    stays eager: it is what differs between layers and steps, and a compiled write into the cache would be one into
    a graph input. Each piece is one graph
    with no break (``fullgraph``; an MoE block's outputs may break where the looped expert path reads counts on the
    host), its token count symbolic (``dynamic``), so every layer and every decode bucket and prefill length share
    it: at most two graphs per piece and grad mode, the second for a single token (TorchDynamo specialises sizes of
    1), and one more for MoE blocks. On a TP replica's local shards (``models.local_tensor_parallel``) the row-parallel
    projections' all-reduces stay inside the second piece, traced as functional collectives, and the graphs are
    shared as on one rank (the local forwards are one function bound to each module). Compiled in place (instance
    attributes over the methods): the first call of each size compiles, which the decode graphs' warm-up pass does
    before capture. ``backend``: TorchDynamo's (tests trace with ``aot_eager``). Once per model: a second engine
    on the same model (``benchmarks/gpu_generate.py`` builds a graphed and an eager one) keeps the compiled pieces."""
    if model.model.carry_residuals:  # compiled by an earlier engine on this model
        return

    def compiled(function: Callable, *, fullgraph: bool = True) -> Callable:
        return torch.compile(function, fullgraph=fullgraph, dynamic=True, backend=backend)

    layers = list(model.model.layers.values())
    layers[0].attention_inputs = compiled(layers[0].attention_inputs)  # the first block has no add to take
    for layer in layers:
        layer.residual_attention_inputs = compiled(layer.residual_attention_inputs)
        layer.attention_outputs_apart = compiled(
            layer.attention_outputs_apart, fullgraph=not isinstance(layer.mlp, MoEBlock)
        )
    model.model.residual_norm = compiled(model.model.residual_norm)
    model.model.carry_residuals = True
    # The step's cos / sin tables (a multiply, a concatenation, cos, sin and two casts) as one kernel.
    model.model.rotary.forward = compiled(model.model.rotary.forward)


def compile_draw(backend: str) -> Callable:
    """``sampler.draw_rows`` compiled (the static decode step's draw). At a 151,936-token vocabulary an eager draw is a
    dozen or more kernels over the ``[rows, vocab]`` logits: a greedy one's division by T, logsumexp's max,
    exponentials and sum, the argmax, the gather, the casts and the stack (about 30 µs of the 1.7 ms batch-1 step on
    an H200, ``docs/benchmarks.md``, session 44); a sampled one's also the probabilities, the greedy rows' argmax
    and the search's chunk masses, each a pass over the vocabulary in float32 (some 1.6 GB per step at 256 rows).
    Inductor fuses them into a few reductions. The same greedy tokens (the argmax of the same float32 quotients),
    log-probs within float32 rounding (the sums' order), and sampled tokens equal but where a target lies within
    that rounding of a token's cumulative mass. Each sampling kind is its own graph (``kind`` is a constant to
    TorchDynamo), the row count and the buffers' length symbolic from the first call: a graph for one row
    (TorchDynamo specialises sizes of 1) and one for any other count, at most six, within its recompile limit; the
    vocabulary stays static, so Inductor sizes its reductions for it.

    Where the backend fails on the draw, the error is logged once and the eager draw serves from then on (the same
    tokens): a step's first call of each shape is the decode graphs' warm-up, outside any capture, so that is where
    it fails."""
    compiled = torch.compile(draw_rows, fullgraph=True, backend=backend)
    failed = False

    def draw_any_rows(logits: torch.Tensor, sampling: torch.Tensor, uniforms: torch.Tensor, *, kind: int):
        nonlocal failed
        if not failed:
            # The rows, and the buffers' length (a static step prepared for more rows makes longer ones).
            for tensor, dim in ((logits, 0), (sampling, 1), (uniforms, 0)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
            try:
                return compiled(logits, sampling, uniforms, kind=kind)
            except Exception as error:  # any compiler failure: the eager draw computes the same
                failed = True
                logger.warning("rollout.compile: the decode step's draw runs eagerly; compiling it failed: %s", error)
        return draw_rows(logits, sampling, uniforms, kind=kind)

    return draw_any_rows
