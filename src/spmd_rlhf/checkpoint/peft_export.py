"""``spmd-rlhf export`` of a role that trained LoRA adapters: its checkpoint holds the adapters (and a critic's head),
not the frozen base, which is read again from the base model directory named in the adapter config.

Without ``merge`` the role becomes a PEFT adapter directory (``peft.PeftModel.from_pretrained(base, dir)`` loads it);
with ``merge`` a full Hugging Face model whose adapted weights are ``W + s B A`` (``s`` each layer's scale,
``LoRAConfig.scale_of``), written tensor by tensor:
at peak one base tensor and its merged copy beside the adapters (``r x (in + out)`` per layer).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoTokenizer

from spmd_rlhf.checkpoint import safe_load
from spmd_rlhf.checkpoint.errors import CheckpointError
from spmd_rlhf.config import LoRAConfig
from spmd_rlhf.models import DecoderLM, read_decoder_args
from spmd_rlhf.models.lora import ADAPTER_SUFFIXES, lora_config_of, write_peft_adapter
from spmd_rlhf.models.safetensors_stream import SafetensorsWriter, TensorEntry, plan_files, write_index
from spmd_rlhf.models.weights import checkpoint_files, write_hf_metadata


def read_trained_tensors(state_dir: Path) -> dict[str, torch.Tensor]:
    """Every model tensor a role's DCP state holds (with LoRA: the adapters and a trained head), in one process."""
    saved = safe_load.read_metadata(state_dir).state_dict_metadata
    tensors = {
        key.removeprefix("model."): torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load.load({"model": tensors}, state_dir, no_dist=True)
    return tensors


def export_lora(config_dir: Path, out: Path, *, merge: bool, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Write the LoRA role whose checkpointed config is ``config_dir`` (``<role>_state/hf_config``) into ``out``."""
    adapter_config = json.loads((config_dir / "lora.json").read_text())
    trained = read_trained_tensors(config_dir.parent)
    tokenizer = AutoTokenizer.from_pretrained(str(config_dir))
    if not merge:
        write_peft_adapter(str(out), trained, adapter_config)
        tokenizer.save_pretrained(str(out))
        return
    base = adapter_config["base_model_name_or_path"]
    try:
        files = checkpoint_files(base)
    except FileNotFoundError as error:
        raise CheckpointError(
            f"--merge reads the frozen base model from {base} (named in {config_dir}/lora.json), which is gone "
            f"({error}); restore it there, or export without --merge (a PEFT adapter)"
        ) from None
    head = json.loads((config_dir / "role.json").read_text())["head"]
    args = read_decoder_args(str(config_dir))
    with torch.device("meta"):
        model = DecoderLM(args, head=head)
    entries = [TensorEntry(name, tuple(param.shape), dtype) for name, param in model.named_parameters()]
    scales = lora_config_of(adapter_config)
    planned_files = plan_files([entries], max_shard_bytes=max_shard_bytes)
    for planned in planned_files:
        with SafetensorsWriter(out, planned) as file:
            for entry in planned.entries:
                file.write(_merged(entry.name, trained, files, scales).to(dtype))
    write_index(out, planned_files)
    write_hf_metadata(out, args, head=head, dtype=dtype, tokenizer=tokenizer)


def _merged(name: str, trained: dict[str, torch.Tensor], files: dict[str, str], scales: LoRAConfig) -> torch.Tensor:
    """The exported value of parameter ``name``: trained in full (a critic's head), or the base tensor plus its
    adapter's ``s B A`` (``s`` its layer's ``scales.scale_of``) when its layer has one, in float32."""
    if name in trained:
        return trained[name].float()
    with safe_open(files[name], framework="pt", device="cpu") as handle:
        tensor = handle.get_tensor(name).float()
    layer = name.removesuffix(".weight")
    lora_a, lora_b = (trained.get(layer + suffix) for suffix in ADAPTER_SUFFIXES)
    if lora_a is not None and lora_b is not None:
        tensor += scales.scale_of(layer) * (lora_b.float() @ lora_a.float())
    return tensor
