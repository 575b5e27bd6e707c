"""The trainer-to-rollout weight sync on 4 ranks: ranks 0-1 train, ranks 2-3 generate. For each pair of layouts,
two syncs (the second after the trainer's weights change), then every side writes the full tensors it holds: the
trainer's masters cast to the rollout dtype (rank 0) and what each rollout rank reassembles from its shards; and the
largest tensor any actor rank made during a sync. Then the same from a background sender: the actor snapshots its
shards, changes its weights and runs the training group's collectives while a thread sends the snapshot; the rollout
must hold the snapshot. ``experts_ep2``: a mixture-of-experts actor whose experts are split over its two ranks
(``ep = 2``) syncing into two whole-model replicas. ``lora_*``: a LoRA actor (FSDP over two ranks, or TP over two)
whose adapters are merged into the weights it sends (``lora.merged_parameters``); rank 0 writes the full merged
weights ``W + s B A`` it expects, computed from the whole tensors. Last, a rollout built from another model: both
sides fail, naming both.

    torchrun --nproc-per-node 4 weight_sync.py POLICY_DIR OTHER_MODEL_DIR MOE_POLICY_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from spmd_rlhf.config import LoRAConfig
from spmd_rlhf.hybrid.weight_sync import (
    BackgroundSender,
    SyncSides,
    receive_weights,
    send_weights,
    snapshot,
    sync_group_ranks,
    trainer_parameters,
)
from spmd_rlhf.models.lora import merged_parameters, merged_weight
from spmd_rlhf.models.parallelize import parallelize
from spmd_rlhf.models.weights import build_model, load_weights
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime import end_process
from spmd_rlhf.workers.rollout import generation_replica

ACTOR, ROLLOUT = (0, 1), (2, 3)
SCENARIOS = {
    "fsdp_to_tp": (ParallelDims(dp=2, tp=1), ParallelDims(dp=1, tp=2)),
    "tp_to_replicas": (ParallelDims(dp=1, tp=2), ParallelDims(dp=2, tp=1)),
    "background": (ParallelDims(dp=2, tp=1), ParallelDims(dp=1, tp=2)),
    "experts_ep2": (ParallelDims(dp=2, ep=2), ParallelDims(dp=2, tp=1)),
    "hsdp_to_tp": (ParallelDims(dp=2, fsdp_size=1), ParallelDims(dp=1, tp=2)),  # two replicas of whole weights
    "lora_fsdp_to_tp": (ParallelDims(dp=2, tp=1), ParallelDims(dp=1, tp=2)),
    "lora_tp_to_replicas": (ParallelDims(dp=1, tp=2), ParallelDims(dp=2, tp=1)),
}
LORA = LoRAConfig(rank=4, alpha=8.0)
ROLLOUT_DTYPE = torch.bfloat16
BUCKET_BYTES = 16_384  # a few parameters per bucket, so the plan has many buckets and a tensor larger than one


def full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param


class LargestAllocation(TorchDispatchMode):
    """The largest storage any op's plain-tensor output lives in while active, the model's own storages (its shards,
    and views of them) left out: the most a rank held at once beyond its weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.bytes = 0
        self.own = {
            (param.to_local() if isinstance(param, DTensor) else param).untyped_storage().data_ptr()
            for param in model.parameters()
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
                storage = leaf.untyped_storage()
                if storage.data_ptr() not in self.own:
                    self.bytes = max(self.bytes, storage.nbytes())
        return out


def perturb(model: torch.nn.Module, seed: int) -> None:
    """An update: every shard moves by a different amount."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.add_(torch.randn(local.shape, generator=generator) * 1e-2)


def merged_full(model: torch.nn.Module, adapters) -> dict[str, torch.Tensor]:
    """The base model's full weights with the adapters merged, in the rollout dtype: what the rollout must hold."""
    params = {name: full(param).detach() for name, param in model.named_parameters()}
    merged = {}
    for name, tensor in params.items():
        layer = name.removesuffix(".weight")
        if name.endswith((".lora_A.weight", ".lora_B.weight")):
            continue
        if layer in adapters.layers:
            lora_a, lora_b = params[f"{layer}.lora_A.weight"], params[f"{layer}.lora_B.weight"]
            tensor = merged_weight(tensor, lora_a, lora_b, adapters.config.scale_of(layer))
        merged[name] = tensor.to(ROLLOUT_DTYPE)
    return merged


def send_in_background(model, sides, rank, actor_group, snapshot_group, version) -> dict[str, torch.Tensor]:
    """Send a snapshot from a thread while the weights change and the training group runs collectives; returns the
    weights as sent (full, in the rollout dtype)."""
    params = trainer_parameters(model)
    copy = snapshot(params, ROLLOUT_DTYPE)
    sent = {name: full(param).detach().clone() for name, param in copy.items()}
    sender = BackgroundSender(torch.device("cpu"), timeout_s=120.0)
    sender.start(
        copy,
        sides=sides,
        rank=rank,
        trainer_group=snapshot_group,
        dtype=ROLLOUT_DTYPE,
        bucket_bytes=BUCKET_BYTES,
        version=version,
        device=torch.device("cpu"),
    )
    for _ in range(20):  # training goes on meanwhile
        perturb(model, seed=100 + rank)
        dist.all_reduce(torch.ones(64), group=actor_group)
    sender.wait()
    return sent


def main() -> None:
    dense, other, moe, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {}
    for scenario, (actor_dims, rollout_dims) in SCENARIOS.items():
        policy = moe if actor_dims.ep > 1 else dense
        actor_mesh = actor_dims.build_mesh(ACTOR, "cpu")
        experts_mesh = actor_dims.build_expert_mesh(actor_mesh)
        hybrid_mesh = actor_dims.build_hybrid_shard_mesh(actor_mesh)
        rollout_mesh = rollout_dims.build_mesh(ROLLOUT, "cpu")
        sync_group = dist.new_group(sync_group_ranks(ACTOR, ROLLOUT))
        actor_group = dist.new_group(list(ACTOR))
        snapshot_group = dist.new_group(list(ACTOR))
        sides = SyncSides(ACTOR[0], ROLLOUT, sync_group if rank in (ACTOR[0], *ROLLOUT) else None, timeout_s=120.0)
        if rank in ACTOR:
            model = build_model(policy, dtype=torch.float32)
            adapters = parallelize(
                model,
                tp_mesh=actor_mesh["tp"],
                dp_mesh=hybrid_mesh if hybrid_mesh is not None else actor_mesh["dp"],
                ep_mesh=experts_mesh["ep"] if experts_mesh is not None else None,
                efsdp_mesh=experts_mesh["efsdp"] if experts_mesh is not None else None,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
                lora=LORA if scenario.startswith("lora") else None,
            )
            load_weights(model, policy, device="cpu")
            if adapters is not None:
                adapters.initialize(model, seed=0)
        else:
            model = generation_replica(
                policy, dtype=ROLLOUT_DTYPE, tp_mesh=rollout_mesh["tp"], device=torch.device("cpu")
            )
        for version in (0, 1):
            if rank in ACTOR:
                if version:
                    # A LoRA actor's replicated adapters (A of a column-parallel layer under TP) move alike on both.
                    perturb(model, seed=0 if adapters is not None else rank)
                if scenario == "background":
                    tensors = send_in_background(model, sides, rank, actor_group, snapshot_group, version)
                    now = {name: full(param).detach().to(ROLLOUT_DTYPE) for name, param in model.named_parameters()}
                    metrics = {"changed_during_send": float(any(not now[name].equal(t) for name, t in tensors.items()))}
                else:
                    params = trainer_parameters(model)
                    if adapters is not None:
                        params = merged_parameters(params, adapters)
                    with LargestAllocation(model) as largest:
                        metrics = send_weights(
                            params,
                            sides=sides,
                            rank=rank,
                            trainer_group=actor_group,
                            dtype=ROLLOUT_DTYPE,
                            bucket_bytes=BUCKET_BYTES,
                            version=version,
                            device=torch.device("cpu"),
                        )
                    allocated = torch.tensor([largest.bytes])
                    dist.all_reduce(allocated, op=dist.ReduceOp.MAX, group=actor_group)
                    metrics["largest_allocation_bytes"] = int(allocated)
                    if adapters is not None:
                        tensors = merged_full(model, adapters)
                        unmerged = {name: full(param).detach() for name, param in model.named_parameters()}
                        torch.save(unmerged, out / f"{scenario}_v{version}_unmerged.pt")
                    else:
                        tensors = {
                            name: full(param).detach().to(ROLLOUT_DTYPE) for name, param in model.named_parameters()
                        }
                if rank == ACTOR[0]:
                    torch.save(tensors, out / f"{scenario}_v{version}_trainer.pt")
                    report[f"{scenario}_v{version}"] = metrics
            else:
                receive_weights(
                    model, sides=sides, bucket_bytes=BUCKET_BYTES, version=version, device=torch.device("cpu")
                )
                tensors = {name: full(param).detach() for name, param in model.named_parameters()}
                torch.save(tensors, out / f"{scenario}_v{version}_rollout{rank}.pt")
    # A rollout of another model: the plan check fails on every rank of both sides.
    actor_mesh = ParallelDims(dp=2, tp=1).build_mesh(ACTOR, "cpu")
    rollout_mesh = ParallelDims(dp=2, tp=1).build_mesh(ROLLOUT, "cpu")
    sync_group = dist.new_group(sync_group_ranks(ACTOR, ROLLOUT))
    actor_group = dist.new_group(list(ACTOR))
    sides = SyncSides(ACTOR[0], ROLLOUT, sync_group if rank in (ACTOR[0], *ROLLOUT) else None, timeout_s=120.0)
    try:
        if rank in ACTOR:
            model = build_model(dense, dtype=torch.float32)
            parallelize(model, tp_mesh=actor_mesh["tp"], dp_mesh=actor_mesh["dp"])
            load_weights(model, dense, device="cpu")
            send_weights(
                trainer_parameters(model),
                sides=sides,
                rank=rank,
                trainer_group=actor_group,
                dtype=ROLLOUT_DTYPE,
                bucket_bytes=BUCKET_BYTES,
                version=7,
                device=torch.device("cpu"),
            )
        else:
            model = generation_replica(
                other, dtype=ROLLOUT_DTYPE, tp_mesh=rollout_mesh["tp"], device=torch.device("cpu")
            )
            receive_weights(model, sides=sides, bucket_bytes=BUCKET_BYTES, version=7, device=torch.device("cpu"))
        error = None
    except RuntimeError as caught:
        error = str(caught)
    (out / f"mismatch_rank{rank}.txt").write_text(error or "no error")
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
