"""Which tensors of a Hugging Face checkpoint hold each of our parameters.

A dense parameter is stored whole under its own name. A mixture-of-experts layer's 3-D expert parameters
(``moe.Experts``) are published one tensor per expert, ``model.layers.N.mlp.experts.{e}.gate_proj.weight`` holding
``model.layers.N.mlp.experts.gate_proj[e]``; Mixtral publishes its MoE block as ``block_sparse_moe`` with experts
``w1`` (gate), ``w3`` (up) and ``w2`` (down). These are the names transformers 5 reads and writes: its conversion
mapping fuses the experts in memory on load and its ``save_pretrained`` splits them again. Every export (whole,
sharded, from a training checkpoint) writes the published layout; loading also reads transformers 5's in-memory one
(``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first, and ``mlp.experts.down_proj [E, H, I]``; Mixtral's block
named ``mlp``), as a ``save_file(model.state_dict())`` of a transformers model holds it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_EXPERT_PARAMETER = re.compile(r"(?P<block>.*\.)mlp\.experts\.(?P<projection>gate_proj|up_proj|down_proj)")
_MIXTRAL_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint and the part of one of our parameters it holds."""

    name: str
    parameter: str
    expert: int | None
    """The tensor is ``parameter[expert]``; None: it holds the whole parameter."""
    shape: tuple[int, ...]
    """The stored tensor's shape."""
    row_offset: int = 0
    """Where the parameter starts in the stored tensor's dim 1 (the up half of a fused ``gate_up_proj``)."""


def stored_tensors(family: str, parameter: str, shape: tuple[int, ...], *, fused: bool = False) -> list[StoredTensor]:
    """The checkpoint tensors of our ``parameter`` of full ``shape`` in a ``family`` model, in the order they are
    written (expert by expert); ``fused``: in transformers 5's in-memory layout instead of the published one."""
    match = _EXPERT_PARAMETER.fullmatch(parameter)
    if fused:
        if match is None or match["projection"] == "down_proj":
            return [StoredTensor(parameter, parameter, None, tuple(shape))]
        experts, width, hidden = shape
        gate_up = f"{match['block']}mlp.experts.gate_up_proj"
        row_offset = width if match["projection"] == "up_proj" else 0
        return [StoredTensor(gate_up, parameter, None, (experts, 2 * width, hidden), row_offset)]
    if match is None:
        name = parameter.replace(".mlp.", ".block_sparse_moe.") if family == "mixtral" else parameter
        return [StoredTensor(name, parameter, None, tuple(shape))]
    block, projection = match["block"], match["projection"]
    if family == "mixtral":
        names = [
            f"{block}block_sparse_moe.experts.{e}.{_MIXTRAL_PROJECTIONS[projection]}.weight" for e in range(shape[0])
        ]
    else:
        names = [f"{block}mlp.experts.{e}.{projection}.weight" for e in range(shape[0])]
    return [StoredTensor(name, parameter, e, tuple(shape[1:])) for e, name in enumerate(names)]


def checkpoint_layout(
    family: str, shapes: dict[str, tuple[int, ...]], stored_names: set[str] | None = None
) -> dict[str, list[StoredTensor]]:
    """Each of our parameters (name -> full shape, in model order) -> its checkpoint tensors: published, or
    transformers 5's fused layout when ``stored_names`` (a checkpoint's tensor names) hold a fused ``gate_up_proj``."""
    fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in stored_names or ())
    return {name: stored_tensors(family, name, shape, fused=fused) for name, shape in shapes.items()}
