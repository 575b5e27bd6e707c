"""A generation copy's tensor parallelism on local tensors (``models.local_tensor_parallel.run_locally``) over 2 gloo
ranks: for a tied Qwen2 (q/k/v biases), an untied Qwen3 (per-head q/k norms) and a Qwen3-MoE (experts split over tp),
each loaded whole on every rank, the logits of a packed row through the DTensor-split copy and through the same copy
after ``run_locally`` must equal the whole model's; afterwards the split copy holds no DTensor hooks.

    torchrun --nproc-per-node 2 tests/models/programs/local_tensor_parallel.py DIR [DIR ...]
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmd_rlhf.models import load_model
from spmd_rlhf.models.local_tensor_parallel import run_locally
from spmd_rlhf.models.merged_linear import merge_projections
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.runtime import end_process


def logits(model, input_ids, position_ids, cu_seqlens):
    with torch.no_grad():
        return model(input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=7)


def split(path, mesh):
    model = load_model(path, dtype=torch.float32)
    parallelize(model, tp_mesh=mesh, dp_mesh=None, gather_logits=True, role="rollout")
    model.requires_grad_(False).eval()
    merge_projections(model)
    return model


def main():
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 300, (1, 12), generator=generator)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
    for path in sys.argv[1:]:
        whole = load_model(path, dtype=torch.float32).eval()
        expected = logits(whole, input_ids, position_ids, cu_seqlens)
        mesh = DeviceMesh.from_group(group, "cpu", mesh=[0, 1], mesh_dim_names=("tp",))
        model = split(path, mesh)
        through_dtensors = logits(model, input_ids, position_ids, cu_seqlens)
        torch.testing.assert_close(through_dtensors, expected, rtol=1e-5, atol=1e-5, msg=path)
        run_locally(model, mesh)
        local = logits(model, input_ids, position_ids, cu_seqlens)
        torch.testing.assert_close(local, expected, rtol=1e-5, atol=1e-5, msg=f"{path} local")
        hooked = [name for name, module in model.named_modules() if module._forward_pre_hooks]
        assert not hooked, f"DTensor hooks left on {hooked}"
    if dist.get_rank() == 0:
        print("local tensor parallelism matches")
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
