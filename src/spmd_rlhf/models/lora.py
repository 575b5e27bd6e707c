"""LoRA adapters (Hu et al. 2021) on a ``DecoderLM``'s linear layers, applied from outside the model like the TP plan.

An adapted layer ``y = W x`` becomes ``y = W x + s * B A dropout(x)`` with ``A: [r, in]`` and ``B: [out, r]`` held as
``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight`` (PEFT's names, so a PEFT adapter file maps onto them by dropping
its ``base_model.model.`` prefix). The scale ``s`` is ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA, and ``r`` and
``alpha`` may differ per layer (PEFT's ``rank_pattern`` and ``alpha_pattern``; ``LoRAConfig.scale_of``). PEFT adapters
of another kind (DoRA, target modules given as a regular expression) are refused by name. The base weights are frozen
and may stay in the model's dtype; the adapters are float32 and are the only parameters that get gradients (a critic's
value head trains too).

Under tensor parallelism each adapter is split like its base layer (the split read from the TP plan):

- column-parallel (q/k/v, gate/up): ``A`` replicated, ``B`` sharded over its output rows (``Shard(0)``) like ``W``;
  ``h = A x`` is computed whole on every rank, and the gradient of ``h`` is summed over the TP group in the backward
  pass (each rank's ``B`` rows see only their slice of the output), so ``A``'s gradient is the same everywhere.
- row-parallel (o, down): ``A`` sharded over its input columns (``Shard(1)``) like ``W``, ``B`` replicated; each rank's
  partial ``A x`` is summed over the TP group in the forward pass (as ``W x`` is).

FSDP2 then shards adapters and base weights of a decoder layer in the layer's unit: one all-gather per unit for both,
and a reduce-scatter of the adapters' gradients only (FSDP2 reduces the parameters that have gradients), so frozen
weights cost no gradient or optimizer memory while adding no collective of their own.

The reference policy is the base with the adapters switched off (``LoRAAdapters.disabled``); generation, export and
the asynchronous weight sync (``merged_parameters``) merge ``W + s B A`` into a copy of the weights
(``merged_weight``), never into the training weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel

from spmd_rlhf.collectives import sum_gradient_over, sum_over, sum_scattered_sequence
from spmd_rlhf.config import LoRAConfig, format_value
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.shard_pieces import local_piece
from spmd_rlhf.models.tp_plan import DECODER_LAYER_PLAN

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a base model's parameter name in adapter_model.safetensors."""
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_KEYS = {
    "rank": "r",
    "alpha": "lora_alpha",
    "use_rslora": "use_rslora",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
}
"""``LoRAConfig`` field -> its adapter_config.json key, for the fields that set an adapter's shape and scale."""
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(name: str) -> bool:
    """The parameter ``name`` is a LoRA adapter's."""
    return name.endswith(ADAPTER_SUFFIXES)


def layer_splits() -> dict[str, str]:
    """Adaptable layer name -> ``column`` or ``row``, read from the TP plan (one fact, one place)."""
    return {
        key.rsplit(".", 1)[1]: "column" if isinstance(style, ColwiseParallel) else "row"
        for key, style in DECODER_LAYER_PLAN.items()
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _AdapterHook:
    """The forward hook that adds an adapter's output to its base layer's (after TP's own hooks: the output is this
    rank's local tensor, the input as the base layer saw it)."""

    adapters: LoRAAdapters
    split: str
    group: dist.ProcessGroup | None
    scale: float
    dropout: float | None
    """The input's dropout probability (PEFT's ``lora_dropout``), None for none: then no call at all. A compiled block
    takes a float attribute as a symbolic input, which ``F.dropout`` must specialise, restarting TorchDynamo's
    analysis (the block traced twice)."""

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not self.adapters.enabled:
            return output
        lora_a, lora_b = _local(module.lora_A.weight), _local(module.lora_B.weight)
        if self.group is not None and self.split == "column":
            # The input went through f in the parent (tp_plan.SharedColumnInput), which sums this path's share of its
            # gradient with the base layer's; A, whole on every rank, takes its gradient summed over tp here.
            lora_a = sum_gradient_over(lora_a, self.group, copy=True)  # to_local()'s view; [rank, in] floats
        x = _local(args[0]).to(lora_a.dtype)
        if self.dropout is not None:
            x = F.dropout(x, self.dropout, training=module.training)
        hidden = F.linear(x, lora_a)
        if self.group is not None and self.split == "row":
            if module.sequence_parallel:
                # The base output is this rank's chunk of the row (tp_plan.RowParallel): the adapter's partial A x
                # are summed into the same chunk (r wide), and B, whole on every rank but applied to each rank's own
                # tokens, takes its gradient summed over tp.
                hidden = sum_scattered_sequence(hidden, self.group)
                lora_b = sum_gradient_over(lora_b, self.group, copy=True)
            else:
                hidden = sum_over(hidden, self.group)
        return output + (F.linear(hidden, lora_b) * self.scale).to(output.dtype)


class LoRAAdapters:
    """The adapters of one model: which layers have them, the switch that turns them all off (the reference policy),
    their initialisation and their PEFT file format."""

    def __init__(self, config: LoRAConfig, layers: dict[str, str]) -> None:
        self.config = config
        self.layers = layers
        """Adapted layer (full module name) -> its TP split, column or row."""
        self.enabled = True

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter's output left out while inside."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    @torch.no_grad()
    def initialize(self, model: nn.Module, *, seed: int) -> None:
        """Fill this rank's pieces of every adapter: from ``config.adapter_path`` (a PEFT adapter) if given, else
        ``A`` uniform in +-1/sqrt(in) (PEFT's Kaiming init) from a generator seeded by ``seed`` and the parameter's
        name (the same full tensor on every rank, whatever the layout) and ``B`` zero, so training starts at the
        base model. Holds one full adapter tensor at a time."""
        stored = read_peft_adapter(self.config) if self.config.adapter_path else None
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            local, piece = local_piece(param)
            if stored is not None:
                full = stored.pop(name)
            elif name.endswith(".lora_B.weight"):
                full = torch.zeros(param.shape)
            else:
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                bound = param.shape[1] ** -0.5
                full = torch.rand(param.shape, generator=generator) * (2 * bound) - bound
            local.copy_(full[piece.slices()])
        if stored:
            raise ValueError(
                f"lora.adapter_path={self.config.adapter_path} holds adapters this model has no layer for "
                f"({', '.join(sorted(stored)[:3])}); use an adapter trained on this base model"
            )

    def peft_config(self, base_model: str, *, head: str = "lm") -> dict:
        """adapter_config.json for PEFT (``PeftModel.from_pretrained`` reads it); a value or score head trains in
        full beside the adapters (PEFT's ``modules_to_save``)."""
        task = {"lm": "CAUSAL_LM", "value": "TOKEN_CLS", "score": "SEQ_CLS"}[head]
        return {
            "peft_type": "LORA",
            "task_type": task,
            "base_model_name_or_path": os.path.abspath(base_model),
            **{peft_key: getattr(self.config, key) for key, peft_key in PEFT_KEYS.items()},
            "lora_dropout": self.config.dropout,
            "target_modules": sorted(self.config.modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "use_dora": False,
            "init_lora_weights": True,
            "modules_to_save": None if head == "lm" else ["score"],
        }


def apply_lora(model: DecoderLM, config: LoRAConfig, *, tp_mesh: DeviceMesh | None) -> LoRAAdapters:
    """Add float32 adapters to ``config.modules`` of every decoder layer of ``model`` (after TP, before FSDP; on the
    meta device like the model), split like their base layers over ``tp_mesh``; freeze everything else but a value
    or score head, which trains in float32 beside the adapters."""
    splits = layer_splits()
    tensor_parallel = tp_mesh is not None and tp_mesh.size() > 1
    group = tp_mesh.get_group() if tensor_parallel else None
    model.requires_grad_(False)
    adapters = LoRAAdapters(config, {})
    for layer_name, layer in model.model.layers.items():
        for module_name, module in layer.named_modules():
            short = module_name.rsplit(".", 1)[-1]
            if short not in config.modules:
                continue
            split, full_name = splits[short], f"model.layers.{layer_name}.{module_name}"
            rank = config.rank_of(full_name)
            out_features, in_features = module.weight.shape  # global shape, also of a TP DTensor
            device = module.weight.device
            pieces = {
                "lora_A": ((rank, in_features), Shard(1) if split == "row" else Replicate()),
                "lora_B": ((out_features, rank), Shard(0) if split == "column" else Replicate()),
            }
            for piece_name, (shape, placement) in pieces.items():
                weight = torch.empty(shape, dtype=torch.float32, device=device)
                if tensor_parallel:
                    weight = distribute_tensor(weight, tp_mesh, [placement])
                holder = nn.Module()
                holder.weight = nn.Parameter(weight)
                module.add_module(piece_name, holder)
            module.register_forward_hook(
                _AdapterHook(adapters, split, group, config.scale_of(full_name), config.dropout or None)
            )
            adapters.layers[full_name] = split
    head = getattr(model, "score", None)
    if head is not None:
        head.to(torch.float32).requires_grad_(True)
    moe = model.args.moe
    if moe is not None:
        logging.getLogger(__name__).info(
            "LoRA on a mixture-of-experts model: the routed experts and routers of its %d MoE layers stay frozen "
            "(adapters go on the %s layers of attention, dense MLPs and shared experts)",
            len(moe.layers),
            ", ".join(sorted(config.modules)),
        )
    return adapters


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B A`` in float32, returned in ``weight``'s dtype (a new tensor: ``weight`` is left as it is)."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


@torch.no_grad()
def merged_parameters(params: dict[str, torch.Tensor], adapters: LoRAAdapters) -> dict[str, torch.Tensor]:
    """``params`` (a LoRA model's parameters by name, as sharded as the model holds them) as the base model's: the
    adapters left out and every adapted weight replaced by this rank's shard of ``W + s B A`` (``merged_weight``),
    with the weight's dtype, mesh and placements, so the asynchronous weight sync sends what a rollout without
    adapters generates with. Every rank holding the parameters calls it together: each adapter is gathered whole
    (``full_tensor``; a layer's adapters are ``r`` rows or columns of its weight) to take the rows and columns of this
    rank's shard. Holds one more copy of this rank's shards of the adapted weights until the result is dropped."""
    merged = {}
    for name, param in params.items():
        layer = name.removesuffix(".weight")
        if is_adapter(name):
            continue
        if layer not in adapters.layers or layer == name:
            merged[name] = param
            continue
        lora_a, lora_b = (_whole(params[f"{layer}.{piece}.weight"]) for piece in ("lora_A", "lora_B"))
        local, piece = local_piece(param)
        rows, columns = piece.slices()
        local = merged_weight(local, lora_a[:, columns], lora_b[rows], adapters.config.scale_of(layer))
        if isinstance(param, DTensor):
            local = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        merged[name] = local
    return merged


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def lora_config_of(saved: dict) -> LoRAConfig:
    """The ranks and scales of the adapters that adapter_config.json ``saved`` describes (``PEFT_KEYS``, PEFT's
    defaults for the optional ones it lacks); its target modules are not read."""
    return LoRAConfig(
        rank=saved["r"],
        alpha=saved["lora_alpha"],
        use_rslora=bool(saved.get("use_rslora")),
        rank_pattern=dict(saved.get("rank_pattern") or {}),
        alpha_pattern=dict(saved.get("alpha_pattern") or {}),
    )


UNREAD_PEFT_OPTIONS = {
    "layers_to_transform": (None, "adapters on some decoder layers only"),
    "layers_pattern": (None, "adapters on some decoder layers only"),
    "exclude_modules": (None, "target modules less some layers"),
    "layer_replication": (None, "decoder layers repeated"),
    "bias": ("none", "trained biases"),
    "lora_bias": (False, "a trained bias on the adapters' B"),
    "modules_to_save": (None, "whole modules trained beside the adapters"),
    "trainable_token_indices": (None, "trained embedding rows"),
    "target_parameters": (None, "adapters on parameters, not layers"),
    "fan_in_fan_out": (False, "transposed (Conv1D) weights"),
}
"""PEFT ``adapter_config.json`` keys that change which layers carry adapters or what they compute, with their default
(at which an adapter is plain LoRA) and what they mean; an adapter with another value is refused by name."""


def read_peft_adapter(config: LoRAConfig) -> dict[str, torch.Tensor]:
    """The adapter tensors of the PEFT directory ``config.adapter_path``, under this model's names; an error naming
    what to change when its ranks, scales or target modules differ from ``config``, or it is a kind of adapter these
    layers are not (DoRA, target modules given as a regular expression)."""
    from safetensors.torch import load_file

    path = config.adapter_path
    config_file, weights_file = os.path.join(path, PEFT_CONFIG), os.path.join(path, PEFT_WEIGHTS)
    if not (os.path.isfile(config_file) and os.path.isfile(weights_file)):
        raise FileNotFoundError(
            f"lora.adapter_path={path}: no {PEFT_CONFIG} and {PEFT_WEIGHTS} there (a PEFT save_pretrained directory)"
        )
    with open(config_file, encoding="utf-8") as handle:
        saved = json.load(handle)
    if saved.get("use_dora"):
        raise ValueError(
            f"lora.adapter_path={path} is a DoRA adapter (use_dora=true), whose magnitude vectors rescale each weight "
            "column, which these LoRA layers cannot; use a LoRA adapter (use_dora=false), or merge it into the base "
            "with PEFT's merge_and_unload and set model.path to the merged model"
        )
    for key, (default, why) in UNREAD_PEFT_OPTIONS.items():
        if saved.get(key, default) not in (default, None, [], {}):
            raise ValueError(
                f"lora.adapter_path={path} has {key}={saved[key]!r}: {why}, which these LoRA layers do not do; "
                f"merge it into the base with PEFT's merge_and_unload and set model.path to the merged model"
            )
    targets = saved.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ValueError(
            f"lora.adapter_path={path} has target_modules={targets!r}, a regular expression over module names, which "
            f"is not read; replace it in {PEFT_CONFIG} by the list of layer names it matches (e.g. "
            '["q_proj", "v_proj"]), which must be the same in every decoder layer'
        )
    # PEFT writes all-linear, short names, or (after expanding all-linear) full module names.
    targets = (
        sorted(layer_splits())
        if targets == "all-linear"
        else sorted({name.rsplit(".", 1)[-1] for name in targets or []})
    )
    if targets != sorted(config.modules):
        raise ValueError(
            f"lora.adapter_path={path} has target_modules={targets}; set lora.target_modules to match "
            f"(now {sorted(config.modules)})"
        )
    found = lora_config_of(saved)
    for key, peft_key in PEFT_KEYS.items():
        theirs, ours = getattr(found, key), getattr(config, key)
        if theirs != ours:
            raise ValueError(
                f"lora.adapter_path={path} has {peft_key}={format_value(theirs)}; set lora.{key} to match "
                f"(now {format_value(ours)})"
            )
    tensors = {name.removeprefix(PEFT_PREFIX): tensor.float() for name, tensor in load_file(weights_file).items()}
    # The first pattern key that matches a layer wins, so equal patterns in another order can still differ.
    for layer in (name.removesuffix(ADAPTER_SUFFIXES[0]) for name in tensors if name.endswith(ADAPTER_SUFFIXES[0])):
        theirs, ours = (found.rank_of(layer), found.scale_of(layer)), (config.rank_of(layer), config.scale_of(layer))
        if theirs != ours:
            raise ValueError(
                f"lora.adapter_path={path} gives {layer} (rank, scale) {theirs}, lora.* gives it {ours}: their pattern "
                f"keys overlap; write lora.rank_pattern and lora.alpha_pattern in the order of its {PEFT_CONFIG}"
            )
    return tensors


def write_peft_adapter(out_dir: str, tensors: dict[str, torch.Tensor], adapters_config: dict) -> list[str]:
    """A PEFT adapter directory: ``adapter_model.safetensors`` (``tensors`` under PEFT's names) and its config."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, PEFT_WEIGHTS)
    save_file({PEFT_PREFIX + name: tensor.contiguous() for name, tensor in tensors.items()}, weights)
    config_file = os.path.join(out_dir, PEFT_CONFIG)
    with open(config_file, "w", encoding="utf-8") as handle:
        json.dump(adapters_config, handle, indent=2)
    return [weights, config_file]
