"""Expert parallelism over all ranks of a gloo job, against one process: each rank routes its own tokens (skewed, so
some experts get none and the splits are uneven) through a whole ``Experts`` module and through this rank's
``ParallelExperts`` share; outputs and input gradients must equal, and each local expert's gradient must equal the
sum over ranks of the whole module's gradient for that expert (every rank's tokens reach it). Both the grouped-GEMM
and the looped path; an ep that does not divide the experts refused; then a whole tiny MoE model with
``shard_experts`` against the unsharded model. ``parallelize`` refuses ``<role>.ep`` on a dense model and on one whose
expert count it does not divide, naming the key.

    torchrun --nproc-per-node N tests/models/programs/expert_parallel.py MODEL_DIR
"""

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from spmd_rlhf.models import DecoderLM, load_model
from spmd_rlhf.models.expert_parallel import ParallelExperts, shard_experts
from spmd_rlhf.models.moe import Experts, TopKRouter
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.runtime import ParallelDims, end_process

EXPERTS, HIDDEN, WIDTH, TOP_K = 8, 32, 16, 2


def check_layer(grouped: bool) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))
    torch.manual_seed(0)  # the same whole layer on every rank
    whole = Experts(EXPERTS, HIDDEN, WIDTH)
    router = TopKRouter(HIDDEN, EXPERTS, top_k=TOP_K, renormalize=True)
    with torch.no_grad():
        router.weight[: EXPERTS // 2] *= 4  # skewed routing: uneven splits, some experts without tokens
    router.requires_grad_(False)
    whole.grouped_mm = grouped
    parallel = ParallelExperts(whole, mesh)
    assert parallel.gate_proj.to_local().shape[0] == EXPERTS // size

    x = torch.randn(13 + 5 * rank, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))  # own rows
    routing = router(x)
    mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected = whole(theirs, routing)
    expected.square().sum().backward()
    out = parallel(mine, routing)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    local = slice(rank * parallel.local, (rank + 1) * parallel.local)
    for name in ("gate_proj", "up_proj", "down_proj"):
        summed = getattr(whole, name).grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(
            getattr(parallel, name).grad.to_local(), summed[local], rtol=1e-5, atol=1e-5, msg=name
        )


def check_model(model_dir: str) -> None:
    rank = dist.get_rank()
    reference = load_model(model_dir, attention_backend="torch")
    model = load_model(model_dir, attention_backend="torch")
    shard_experts(model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))
    ids = torch.randint(3, reference.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)


def check_refusals(model_dir: str) -> None:
    size = dist.get_world_size()
    dims = ParallelDims(dp=size, ep=size)
    mesh = dims.build_mesh(tuple(range(size)), "cpu")
    experts_mesh = dims.build_expert_mesh(mesh)
    args = load_model(model_dir, attention_backend="torch").args
    cases = {
        "has no mixture-of-experts layers to split; set actor.ep=1": dataclasses.replace(args, moe=None),
        f"does not divide the model's {2 * size + 1} experts": dataclasses.replace(
            args, moe=dataclasses.replace(args.moe, num_experts=2 * size + 1)
        ),
    }
    for message, case in cases.items():
        with torch.device("meta"):
            model = DecoderLM(case)
        try:
            parallelize(
                model,
                tp_mesh=None,
                dp_mesh=mesh["dp"],
                ep_mesh=experts_mesh["ep"],
                efsdp_mesh=experts_mesh["efsdp"],
                role="actor",
            )
            raise AssertionError(f"accepted: {message}")
        except ValueError as error:
            assert str(error).startswith(f"actor.ep={size}") and message in str(error), error


def main() -> None:
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
        ParallelExperts(Experts(EXPERTS + 1, HIDDEN, WIDTH), mesh)
        raise AssertionError("an ep that does not divide the experts was accepted")
    except ValueError as error:
        assert f"ep={dist.get_world_size()} does not divide the model's {EXPERTS + 1} experts" in str(error), error
    for grouped in (True, False):
        check_layer(grouped)
    check_model(sys.argv[1])
    check_refusals(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
