"""What a role's sharded model writes for people and other tools: the model config and tokenizer beside a checkpoint,
a Hugging Face directory streamed from the shards, or with LoRA a PEFT adapter directory. Mixed into
``ShardedModel``, whose state (``module``, ``context``, ``adapters``, the groups) it reads."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

from spmd_rlhf.checkpoint import save_model_config
from spmd_rlhf.models.lora import write_peft_adapter
from spmd_rlhf.models.sharded_save import save_sharded_pretrained


class PretrainedExport:
    """``ShardedModel``'s writers (every rank of the role calls ``save_pretrained``; rank 0 alone writes the
    config)."""

    def save_config(self, checkpoint_dir: str) -> None:
        """The model config and tokenizer that ``spmd-rlhf export`` needs to rebuild the model from a checkpoint alone
        (written by role rank 0)."""
        if self.context.role_rank == 0:
            adapter_config = (
                None if self.adapters is None else self.adapters.peft_config(self.model_path, head=self.module.head)
            )
            save_model_config(
                checkpoint_dir, self.module, tokenizer_path=self.tokenizer_path, adapter_config=adapter_config
            )

    def save_pretrained(self, out_dir: str) -> str:
        """With LoRA, the trained adapters as a PEFT adapter directory (``_save_adapter``). Otherwise write the
        current weights as a Hugging Face directory in ``trainer.save_hf_dtype`` (default
        ``model.dtype``), streamed from the shards: each pipeline stage's first rank writes that stage's files,
        gathering one row band of one tensor at a time (``models.sharded_save``); returns ``out_dir``. Every rank of
        the role calls it."""
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                # The copy reads the sharded master weights, whatever gathered state the last forward left behind.
                module.reshard()
        if self.adapters is not None:
            return self._save_adapter(out_dir)
        dims, role_rank = self.context.dims, self.context.role_rank
        per_stage = dims.dp * dims.tp
        stage_start = role_rank // per_stage * per_stage
        tokenizer = None
        if role_rank == 0:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        save_sharded_pretrained(
            self.module,
            out_dir,
            stage=self.context.coordinates.pp,
            stage_ranks=list(self.context.ranks[stage_start : stage_start + per_stage]),
            writers_group=self.pp_group,
            group=self.role_group,
            dtype=getattr(torch, self.config.trainer.save_hf_dtype or self.config.model.dtype),
            device=self.device,
            tokenizer=tokenizer,
        )
        return out_dir

    def _save_adapter(self, out_dir: str) -> str:
        """The trained parameters (LoRA adapters, and a critic's head) as a PEFT adapter directory with the tokenizer,
        which ``peft.PeftModel.from_pretrained`` loads onto the base model (``model_path``). Each adapter is
        gathered whole (``r x (in + out)`` values: small beside the model) on every rank of its stage; the stages'
        adapters meet on role rank 0, which writes."""
        tensors = {
            name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().float().cpu()
            for name, param in self.module.named_parameters()
            if param.requires_grad
        }
        if self.pp_group is not None:
            stages: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(self.pp_group))]
            dist.all_gather_object(stages, tensors, group=self.pp_group)
            tensors = {name: tensor for stage in stages for name, tensor in stage.items()}
        if self.context.role_rank == 0:
            write_peft_adapter(out_dir, tensors, self.adapters.peft_config(self.model_path, head=self.module.head))
            AutoTokenizer.from_pretrained(self.tokenizer_path).save_pretrained(out_dir)
        return out_dir
