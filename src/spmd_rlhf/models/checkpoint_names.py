"""Which tensors of a published Hugging Face checkpoint hold each of our parameters.

A dense parameter is stored whole under its own name. A mixture-of-experts layer's 3-D expert parameters
(``moe.Experts``) are stored one tensor per expert, ``model.layers.N.mlp.experts.{e}.gate_proj.weight`` holding
``model.layers.N.mlp.experts.gate_proj[e]``; Mixtral publishes its MoE block as ``block_sparse_moe`` with experts
``w1`` (gate), ``w3`` (up) and ``w2`` (down). These are the names transformers 5 reads and writes: its conversion
mapping fuses the experts in memory on load (``experts.gate_up_proj``) and its ``save_pretrained`` splits them again.
Loading and every export (whole, sharded, from a training checkpoint) read this one mapping.
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
    """The tensor is ``parameter[expert]``; None: the whole parameter."""
    shape: tuple[int, ...]


def stored_tensors(family: str, parameter: str, shape: tuple[int, ...]) -> list[StoredTensor]:
    """The checkpoint tensors of our ``parameter`` of full ``shape`` in a ``family`` model, in the order they are
    written (expert by expert)."""
    match = _EXPERT_PARAMETER.fullmatch(parameter)
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


def checkpoint_layout(family: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[StoredTensor]]:
    """Each of our parameters (name -> full shape, in model order) -> its checkpoint tensors."""
    return {name: stored_tensors(family, name, shape) for name, shape in shapes.items()}
