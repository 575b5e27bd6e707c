"""A trained role's sharded state through DCP: model, optimizer, LR schedule and each rank's RNG state, saved
and loaded in any layout, plus the model config export needs besides the weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from spmd_rlhf.checkpoint import safe_load
from spmd_rlhf.checkpoint.directory import HF_CONFIG, LORA_FILE, ROLE_FILE
from spmd_rlhf.checkpoint.errors import CheckpointError
from spmd_rlhf.models import DecoderLM

TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""A role's saved model state: its trained parameters (all of them, or with LoRA the adapters and a critic's head;
the frozen base is read again from its model directory)."""
LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading that state leaves the frozen parameters as loaded from the model directory (``_check_model_shapes``
has checked that every trained one is in the checkpoint)."""


# ---- a role's sharded training state ---------------------------------------------------------------------------------


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _rng_key(process_group: dist.ProcessGroup | None) -> str:
    # One key per rank: DCP keeps one copy of a key that several ranks save, and the RNG states differ by rank.
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    return f"rng_rank{rank}"


def save_role_state(
    state_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Save model, optimizer, LR schedule and this rank's RNG state with DCP (collective over ``process_group``, which
    must span every rank of the role): each rank writes its own shards."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        _rng_key(process_group): _rng_state(),
    }
    _check_free_space(state_dir, state, process_group)
    dcp.save(state, checkpoint_id=str(state_dir), process_group=process_group)


def _check_free_space(
    state_dir: str | os.PathLike, state: dict[str, Any], process_group: dist.ProcessGroup | None
) -> None:
    """Refuse, on every rank of the role at once, a save that cannot fit: a full disk otherwise fails deep inside DCP's
    ``torch.save`` ("unexpected pos ... vs ...") after part of the state is written. A rank needs its tensors' bytes
    times the ranks of its host that write beside it (torchrun's LOCAL_WORLD_SIZE)."""
    tensors = [leaf for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor)]
    local = sum((leaf.to_local() if isinstance(leaf, DTensor) else leaf).nbytes for leaf in tensors)
    writers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    directory = Path(state_dir)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    free = shutil.disk_usage(directory).free
    short = torch.tensor([float(local * writers > free)], device=_state_device(tensors))
    if dist.is_initialized():
        dist.all_reduce(short, op=dist.ReduceOp.MAX, group=process_group)
    if short.item():
        raise CheckpointError(
            f"saving {state_dir} needs about {local * writers / 2**30:.2f} GiB on this host ({writers} rank(s) "
            f"writing {local / 2**30:.2f} GiB each) and {directory} has {free / 2**30:.2f} GiB free (this rank or "
            "another of the role is short): free space there or set trainer.output_dir to a larger disk"
        )


def _state_device(tensors: list[torch.Tensor]) -> torch.device:
    """Where the role's collectives take tensors: its model's device (CPU with none)."""
    for tensor in tensors:
        if tensor.device.type != "cpu":
            return tensor.device
    return torch.device("cpu")


def load_role_state(
    state_dir: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    process_group: dist.ProcessGroup | None,
) -> None:
    """Restore what ``save_role_state`` wrote, resharded to this layout (any DP size). A rank restores its RNG state
    when the saving job had a rank of that index (and the same devices); otherwise it keeps its own."""
    _create_optimizer_state(optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict()}
    rng_key = _rng_key(process_group)
    saved = safe_load.read_metadata(state_dir).state_dict_metadata
    _check_model_shapes(state_dir, model_state, saved)
    rng = {device: tensor for device, tensor in _rng_state().items() if f"{rng_key}.{device}" in saved}
    if rng:
        state[rng_key] = rng
    safe_load.load(state, state_dir, process_group=process_group)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=LOAD_TRAINED_ONLY,
    )
    scheduler.load_state_dict(state["scheduler"])
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])


@torch.no_grad()
def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (DCP loads into existing tensors), one parameter at a time: a step with a
    zero gradient and the learning rate at 0 changes no weight. ``get_state_dict`` would do it with a zero gradient
    for every parameter at once, one whole gradient shard of transient memory on top of the weights and moments."""
    if optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
                    optimizer.step()
                    param.grad = None
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate


def _check_model_shapes(state_dir: str | os.PathLike, model_state: dict[str, Any], saved: dict[str, Any]) -> None:
    """One error naming the tensors whose saved shapes differ from this model's (or that it lacks), before DCP's
    own per-rank errors: the checkpoint is of another model."""
    problems = []
    for name, tensor in model_state.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{name} missing")
        elif tuple(entry.size) != tuple(tensor.shape):
            problems.append(f"{name} {list(entry.size)} saved, {list(tensor.shape)} here")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")
        raise CheckpointError(
            f"{state_dir} holds another model ({shown}); resume with the model it was trained from (model.path), "
            f"or start fresh with trainer.resume=null or another trainer.output_dir"
        )


def save_model_config(
    state_dir: str | os.PathLike, model: DecoderLM, *, tokenizer_path: str, adapter_config: dict | None = None
) -> None:
    """Write what rebuilds ``model`` without its original directory (HF config, tokenizer, head; with LoRA the
    adapter config naming the base model, whose weights the checkpoint does not hold) into the role's state; one
    rank of the role calls it."""
    from transformers import AutoTokenizer

    config_dir = Path(state_dir, HF_CONFIG)
    config_dir.mkdir(parents=True, exist_ok=True)
    model.args.hf_config.save_pretrained(config_dir)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(config_dir)
    (config_dir / ROLE_FILE).write_text(json.dumps({"head": model.head}))
    if adapter_config is not None:
        (config_dir / LORA_FILE).write_text(json.dumps(adapter_config, indent=2))
