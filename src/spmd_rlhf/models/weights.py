"""Hugging Face safetensors I/O: build on the meta device, materialise tensor by tensor; write HF directories.

model = load_model("tiny/model", head="lm", dtype=torch.bfloat16, device="cuda")
save_pretrained(model, "out/hf", tokenizer=tokenizer)
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections import defaultdict

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from spmd_rlhf.models.args import DecoderArgs, read_decoder_args
from spmd_rlhf.models.checkpoint_names import StoredTensor, checkpoint_layout
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.safetensors_stream import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsWriter,
    TensorEntry,
    plan_files,
    write_index,
)
from spmd_rlhf.models.shard_pieces import local_piece

_ARCHITECTURE_PREFIX = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
    "mixtral": "Mixtral",
}
_ARCHITECTURE_SUFFIX = {"lm": "ForCausalLM", "value": "ForTokenClassification", "score": "ForSequenceClassification"}


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model built from its config (missing, unexpected, wrong shape)."""


def _open(file: str):
    """``safe_open`` on the CPU, with an error naming the file when it is not a whole safetensors file."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(
            f"{file} is not a readable safetensors file ({error}); it is truncated or corrupt: download or save the "
            f"model again"
        ) from None


def checkpoint_files(path: str) -> dict[str, str]:
    """Map each tensor name in a HF directory (single file or sharded with an index) to the file holding it."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with _open(single) as handle:
            return {name: single for name in handle.keys()}
    found = sorted(name for name in os.listdir(path) if name.endswith((".bin", ".pt", ".pth")))
    hint = (
        f" (found {', '.join(found)}: only safetensors are loaded; convert with transformers' save_pretrained)"
        if found
        else ""
    )
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _tensor_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    for file, names in by_file.items():
        with _open(file) as handle:
            for name in names:
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def model_layout(model: DecoderLM, stored_names: set[str] | None = None) -> dict[str, list[StoredTensor]]:
    """Each parameter of ``model`` (whole shapes, also when it is sharded) -> the checkpoint tensors holding it, as
    published, or as a checkpoint of ``stored_names`` holds them (``checkpoint_layout``)."""
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    return checkpoint_layout(model.args.family, shapes, stored_names)


def _plan_load(model: DecoderLM, shapes: dict[str, tuple[int, ...]]) -> tuple[list[str], list[str]]:
    """Decide which parameters come from the checkpoint; raise one error listing every mismatch.

    Returns ``(parameters loaded from the checkpoint, parameters left to initialise)``. Checkpoint tensors are
    named as published (``checkpoint_names``: an MoE layer's experts one tensor each) or fused as transformers 5
    holds them in memory. Rules beyond exact name
    matches: a tied LM head ignores a stored ``lm_head.weight`` copy; a value head (critic) built from a causal-LM
    checkpoint ignores ``lm_head.weight`` and starts with a zero ``score`` layer, and built from a reward model takes
    its ``score.weight`` and starts with a zero bias.
    """
    layout = model_layout(model, set(shapes))
    expected = {stored.name: stored.shape for parts in layout.values() for stored in parts}
    ignorable = set()
    to_initialise = []
    if model.head == "lm" and model.args.tie_word_embeddings:
        ignorable.add("lm_head.weight")
    if model.head == "value":
        ignorable.add("lm_head.weight")
        to_initialise = [name for name in ("score.weight", "score.bias") if name not in shapes]
    missing = sorted(set(expected) - set(shapes) - set(to_initialise))
    unexpected = sorted(set(shapes) - set(expected) - ignorable)
    wrong_shape = [
        f"{name} (checkpoint {list(shapes[name])}, model {list(shape)})"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong_shape))
        if items
    ]
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint does not match a {model.args.family} model with head={model.head!r}: " + "; ".join(problems)
        )
    return [name for name, parts in layout.items() if parts[0].name in shapes], to_initialise


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor, *, parameter: bool) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if parameter:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = tensor


def load_model(
    path: str,
    *,
    head: str = "lm",
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "auto",
) -> DecoderLM:
    """Load a Hugging Face directory as a ``DecoderLM`` with the given head.

    The model is built on the meta device and each tensor is read from safetensors, cast and placed on ``device`` one
    at a time, so the weights are never held twice. Any mismatch between checkpoint and config is one error.
    """
    model = build_model(path, head=head, dtype=dtype, attention_backend=attention_backend)
    load_weights(model, path, device=device)
    return model


def build_model(
    path: str, *, head: str = "lm", dtype: torch.dtype | str = torch.float32, attention_backend: str = "auto"
) -> DecoderLM:
    """The model of a Hugging Face directory on the meta device, in ``dtype``, checked against the checkpoint's
    tensors (one error naming every mismatch). Parallelize it, then ``load_weights``."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = DecoderLM(read_decoder_args(path), head=head, attention_backend=attention_backend).to(dtype)
    _plan_load(model, _tensor_shapes(checkpoint_files(path)))
    return model


@torch.no_grad()
def load_weights(model: DecoderLM, path: str, *, device: torch.device | str) -> int:
    """Materialise a model built by ``build_model`` (maybe cut to a pipeline stage and parallelized since) on
    ``device`` and fill each parameter from the checkpoint. Each rank reads only its own piece of each tensor (the
    rectangle its TP, FSDP and PP shard covers, with safetensors' ``get_slice``; a plain tensor whole) and casts it
    to the parameter's dtype: at peak it holds its shard plus one piece as stored. Parameters the architecture does
    not have (LoRA adapters) are left to whoever added them. Returns the bytes read."""
    device = torch.device(device)
    files = checkpoint_files(path)
    in_checkpoint, to_initialise = _plan_load(_meta_copy(model), _tensor_shapes(files))
    in_checkpoint = set(in_checkpoint)
    layout = model_layout(model, set(files))
    model.to_empty(device=device)
    model.tie_weights()
    model.reset_buffers()
    read = 0
    for name, param in model.named_parameters():
        local, piece = local_piece(param)
        if name in to_initialise:
            local.zero_()
            continue
        if name not in in_checkpoint:
            continue  # added from outside the architecture (LoRA adapters): their owner fills them
        if not local.numel():
            continue
        for stored in layout[name]:
            # Each checkpoint tensor's rectangle of this rank's piece (an expert's, for a 3-D expert parameter).
            target, part = local_piece(param, stored.expert)
            if not target.numel():
                continue
            if stored.row_offset:
                part = dataclasses.replace(
                    part, offset=(part.offset[0], part.offset[1] + stored.row_offset, *part.offset[2:])
                )
            # One open per tensor: the file's pages touched through the memory map are released with it.
            with _open(files[stored.name]) as handle:
                data = handle.get_slice(stored.name)[part.slices()]
            read += data.nbytes
            target.copy_(data.to(device=device, dtype=target.dtype))
            del data
    return read


def _meta_copy(model: DecoderLM) -> DecoderLM:
    """A whole unparallelized meta model of the same architecture (what the checkpoint is checked against)."""
    with torch.device("meta"):
        return DecoderLM(model.args, head=model.head, attention_backend=model.attention_backend)


def model_from_tensors(
    args: DecoderArgs,
    tensors: dict[str, torch.Tensor],
    *,
    head: str = "lm",
    attention_backend: str = "auto",
) -> DecoderLM:
    """A ``DecoderLM`` whose parameters *are* ``tensors`` (no copy): e.g. the generation copy of a sharded actor,
    assembled from gathered shards. A tied LM head needs only the embedding. Buffers go on the tensors' device."""
    with torch.device("meta"):
        model = DecoderLM(args, head=head, attention_backend=attention_backend)
    expected = {name for name, _ in model.named_parameters()}
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise CheckpointMismatchError(f"model_from_tensors: missing {missing}, unexpected {unexpected}")
    for name, tensor in tensors.items():
        _set_tensor(model, name, tensor, parameter=True)
    device = next(iter(tensors.values())).device
    for name, buffer in model.named_buffers():
        _set_tensor(model, name, torch.empty_like(buffer, device=device), parameter=False)
    model.tie_weights()
    model.reset_buffers()
    return model


def write_hf_metadata(
    out_dir: str | os.PathLike, args: DecoderArgs, *, head: str, dtype: torch.dtype, tokenizer=None
) -> list[str]:
    """``config.json`` of a ``head`` model with weights in ``dtype`` (and the tokenizer's files when given) in
    ``out_dir``; returns the files written."""
    config = copy.deepcopy(args.hf_config)
    config.architectures = [_ARCHITECTURE_PREFIX[args.family] + _ARCHITECTURE_SUFFIX[head]]
    if head != "lm":
        config.num_labels = 1
    config.dtype = dtype
    config.save_pretrained(out_dir)
    written = [os.path.join(out_dir, "config.json")]
    if tokenizer is not None:
        written.extend(tokenizer.save_pretrained(out_dir))
    return written


@torch.no_grad()
def save_pretrained(
    model: DecoderLM,
    out_dir: str,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> list[str]:
    """Write ``model`` (whole, in this process) as a Hugging Face directory that ``transformers`` ``from_pretrained``
    loads, in ``dtype`` (None: the parameters' own).

    Tensors go into ``model.safetensors``, or into ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` (a single larger tensor gets its own shard) with an index, named as published
    (``checkpoint_names``: experts one tensor each). Each tensor (each expert) is converted and written on its own: at
    peak this holds the model plus one converted tensor. Returns the files written.
    """
    os.makedirs(out_dir, exist_ok=True)
    # named_parameters drops the tied lm_head alias, exactly as Hugging Face stores tied checkpoints.
    params = dict(model.named_parameters())
    dtype = dtype or next(iter(params.values())).dtype
    stored = {part.name: part for parts in model_layout(model).values() for part in parts}
    files = plan_files(
        [[TensorEntry(name, part.shape, dtype) for name, part in stored.items()]], max_shard_bytes=max_shard_bytes
    )
    written = []
    for planned in files:
        with SafetensorsWriter(out_dir, planned) as file:
            for entry in planned.entries:
                part = stored[entry.name]
                tensor = params[part.parameter].detach()
                tensor = tensor if part.expert is None else tensor[part.expert]
                file.write(tensor.to(device="cpu", dtype=dtype))
        written.append(str(file.path))
    index = write_index(out_dir, files)
    written.extend([index] if index else [])
    return written + write_hf_metadata(out_dir, model.args, head=model.head, dtype=dtype, tokenizer=tokenizer)
