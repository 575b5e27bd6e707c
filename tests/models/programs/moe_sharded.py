"""A mixture-of-experts model under FSDP2 on 1 rank and on 2 gloo ranks (each then holds half of every layer's
experts): each rank's loaded pieces equal a single-process load, the logits and the experts' gradients equal the
single-process model's, and the streamed save from 2 ranks writes the published per-expert layout to ``OUT_DIR``.
Then tensor parallelism over the 2 ranks (each expert's width, the shared expert and attention split; the router and
the shared expert's gate whole): logits and every parameter's gradient equal the single-process model's.

    torchrun --nproc-per-node 2 tests/models/programs/moe_sharded.py MODEL_DIR OUT_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from spmd_rlhf.models import load_model
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.shard_pieces import local_piece
from spmd_rlhf.models.sharded_save import save_sharded_pretrained
from spmd_rlhf.models.weights import build_model, load_weights
from spmd_rlhf.runtime import end_process


def sharded_like_one_process(model_dir: str, dp_mesh, reference) -> torch.nn.Module:
    """The model under FSDP2 over ``dp_mesh``, checked against ``reference`` (one process): the loaded pieces, the
    logits, and the expert gradients."""
    model = build_model(model_dir, attention_backend="torch")
    parallelize(model, tp_mesh=None, dp_mesh=dp_mesh)
    load_weights(model, model_dir, device="cpu")
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        local, piece = local_piece(param)
        torch.testing.assert_close(local, expected[name][piece.slices()], rtol=0, atol=0, msg=name)
    experts = model.model.layers["0"].mlp.experts.gate_proj
    held = local_piece(experts)[1].shape[0]
    assert held == experts.shape[0] // dp_mesh.size(), f"{held} of {experts.shape[0]} experts on {dp_mesh.size()} ranks"

    ids = torch.randint(3, reference.args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    reference.zero_grad()
    logits = model(ids)
    torch.testing.assert_close(logits, reference(ids), rtol=0, atol=1e-5)
    logits.logsumexp(-1).sum().backward()
    reference(ids).logsumexp(-1).sum().backward()
    for name, param in model.named_parameters():
        if "experts" in name:
            local, piece = local_piece(param.grad)
            torch.testing.assert_close(local, expected[name].grad[piece.slices()], rtol=1e-5, atol=1e-6, msg=name)
    return model


def tensor_parallel_like_one_process(model_dir: str, reference) -> None:
    model = build_model(model_dir, attention_backend="torch")
    parallelize(model, tp_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), dp_mesh=None, gather_logits=True)
    load_weights(model, model_dir, device="cpu")
    moe, block = reference.args.moe, model.model.layers["0"].mlp
    assert block.experts.gate_proj.to_local().shape[1] * 2 == moe.moe_intermediate_size
    assert block.shared_expert.gate_proj.weight.to_local().shape[0] * 2 == moe.shared_expert_intermediate_size
    ids = torch.randint(3, reference.args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    reference.zero_grad()
    logits = model(ids)
    torch.testing.assert_close(logits, reference(ids), rtol=0, atol=1e-5)
    logits.logsumexp(-1).sum().backward()
    reference(ids).logsumexp(-1).sum().backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        gradient = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(gradient, expected[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def main() -> None:
    dist.init_process_group("gloo")
    model_dir, out_dir = sys.argv[1:]
    reference = load_model(model_dir, attention_backend="torch")
    one_rank = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replica", "dp"))["dp"]
    sharded_like_one_process(model_dir, one_rank, reference)
    model = sharded_like_one_process(model_dir, init_device_mesh("cpu", (2,)), reference)
    save_sharded_pretrained(
        model,
        out_dir,
        stage=0,
        stage_ranks=[0, 1],
        writers_group=None,
        group=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        band_bytes=4096,
    )
    tensor_parallel_like_one_process(model_dir, reference)
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
