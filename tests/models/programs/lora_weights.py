"""LoRA adapters as the multi-rank programs set them: initialised as ``LoRAAdapters.initialize`` does, then every
``B`` random (zero, as initialised, it would give ``A`` no gradient), the same whole tensor in every model and on
every rank, each rank keeping its piece."""

import torch
import torch.distributed as dist


def randomize_adapters(model: torch.nn.Module, adapters) -> None:
    adapters.initialize(model, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                full = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1
                if hasattr(param, "placements") and param.placements[0].is_shard():
                    param.to_local().copy_(full.chunk(dist.get_world_size())[dist.get_rank()])
                else:
                    (param.to_local() if hasattr(param, "to_local") else param).copy_(full)
