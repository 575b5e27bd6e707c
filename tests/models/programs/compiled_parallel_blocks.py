"""Compiled decoder blocks under tensor, context and expert parallelism, over every rank of a gloo job
(``model.compile``, ``parallelize.compile_block`` traced with ``aot_eager``), against the same model with eager blocks
on the same rank:

- tensor parallelism over every rank, a tiny Qwen3 (per-head q/k norms, tied vocabulary-parallel embedding and head)
  under FSDP2 on a one-rank dp mesh (its unsharded parameters DTensors over tp), packed rows: logits and every
  gradient, one graph per attention layout with no break (the blocks' TP forwards on local shards, ``tp_plan``), and
  the eager pass's all-reduces (six per layer: each shared input's gradient summed once; compiled LoRA adapters
  under TP: ``programs/sequence_parallel.py``);
- context parallelism, a tiny Qwen3 (per-head q/k norms) over packed rows of mixed lengths, each rank its chunk:
  Ulysses (its all-to-alls inside one graph, no break; under selective activation checkpointing, where the compiled
  forward runs inside the checkpoint and its all-to-alls again in the backward) and ring attention (the graph broken
  only where ``ring_attend`` runs its exchanges eagerly): the chunk's hidden states and every parameter's gradient;
- expert parallelism, a tiny Qwen3-MoE with ``shard_experts`` over every rank, each rank its own tokens: logits and
  every gradient (the experts' shares included).

Each compiled model compiles one graph (or one pair of pieces around the ring) shared by its layers, not one per
layer.

    torchrun --nproc-per-node 2 tests/models/programs/compiled_parallel_blocks.py DENSE_DIR MOE_DIR
"""

import itertools
import sys

import torch
import torch.distributed as dist
from dynamo_checks import restarted_analyses
from torch._dynamo.utils import compilation_time_metrics, counters
from torch.distributed.device_mesh import init_device_mesh

from spmd_rlhf.metrics.dispatch_counts import DispatchCounts
from spmd_rlhf.models import load_model
from spmd_rlhf.models import parallelize as parallelize_module
from spmd_rlhf.models.expert_parallel import shard_experts
from spmd_rlhf.models.ring_attention import zigzag_positions
from spmd_rlhf.runtime import end_process

ROWS = ([12, 14, 10], [20, 4, 6, 2], [30, 2])
"""Packed rows (sequence lengths; each a multiple of 4 tokens in all, as ring attention at cp = 2 needs)."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def check_gradients(eager: torch.nn.Module, compiled: torch.nn.Module, what: str) -> None:
    for (name, theirs), ours in zip(eager.named_parameters(), compiled.parameters()):
        if theirs.grad is None:
            assert ours.grad is None, (what, name)
            continue
        torch.testing.assert_close(local(ours.grad), local(theirs.grad), rtol=1e-5, atol=1e-6, msg=f"{what} {name}")


def assert_traced_once(what: str) -> None:
    """No frame's analysis was restarted (a float input an operator had to specialise; where the design breaks the
    graph, around the ring's exchanges and the experts' all-to-alls, the pieces are traced again by design)."""
    assert not restarted_analyses(), (what, restarted_analyses())


def tensor_parallel(model_dir: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    models = []
    for compiled in (False, True):
        model = load_model(model_dir, head="lm", dtype=torch.float32)
        parallelize_module.parallelize(model, tp_mesh=mesh["tp"], dp_mesh=mesh["dp"], compile_layers=compiled)
        models.append(model)
    generator = torch.Generator().manual_seed(0)  # the same rows on every rank, as TP ranks take them
    for lengths in ROWS:
        ids = torch.randint(3, models[0].args.vocab_size, (1, sum(lengths)), generator=generator)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        logits = []
        for model in models:
            model.zero_grad()
            out = model(input_ids=ids, cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
            out.pow(2).mean().backward()
            logits.append(out)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-6, msg="tensor parallel")
        check_gradients(*models, "tensor parallel")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])  # two attention layouts
    assert_traced_once("tensor parallel")
    counts = DispatchCounts()
    with counts:
        models[0](input_ids=ids, cu_seqlens=cu_seqlens, max_seqlen=max(lengths)).pow(2).mean().backward()
    all_reduces = counts.calls["c10d.allreduce_"] + counts.calls["_c10d_functional.all_reduce"]
    # Per layer: o's and down's outputs; the gradients of q/k/v's one input and of gate/up's (each summed once for its
    # layers, tp_plan.SharedColumnInput), of q_norm's and k_norm's weights. Then the embedding's output and the LM
    # head's input gradient.
    assert all_reduces == 6 * len(models[0].model.layers) + 2, dict(counts.calls)


def context_parallel(model_dir: str, attention: str, *, checkpointing: bool) -> None:
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    models = []
    for compiled in (False, True):
        model = load_model(model_dir, head="lm", dtype=torch.float32)
        parallelize_module.parallelize(
            model,
            tp_mesh=None,
            dp_mesh=None,
            cp_group=dist.group.WORLD,
            cp_attention=attention,
            activation_checkpointing=checkpointing,
            checkpoint_policy="selective",
            compile_layers=compiled,
        )
        models.append(model)
    what = f"{attention} checkpointing={checkpointing}"
    generator = torch.Generator().manual_seed(0)  # the same rows on every rank
    for lengths in ROWS:
        tokens = sum(lengths)
        ids = torch.randint(3, models[0].args.vocab_size, (tokens,), generator=generator)
        positions = torch.cat([torch.arange(length) for length in lengths])
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        if attention == "ring":
            mine = zigzag_positions(rank, cp, tokens)
        else:
            mine = torch.arange(rank * tokens // cp, (rank + 1) * tokens // cp)
        hidden = []
        for model in models:
            model.zero_grad()
            out = model.hidden_states(
                ids[mine][None],
                positions[mine][None],
                cu_seqlens=cu_seqlens,
                max_seqlen=max(lengths),
                row_length=tokens,
            )
            out.pow(2).mean().backward()
            hidden.append(out)
        torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-5, atol=1e-6, msg=what)
        check_gradients(*models, what)
    breaks = dict(counters["graph_break"])
    if attention == "ulysses":
        assert not breaks, (what, breaks)
        assert_traced_once(what)
        assert counters["stats"]["unique_graphs"] <= 2, (what, dict(counters["stats"]))  # two attention layouts
    else:
        assert breaks and all("_ring_over_the_row" in reason for reason in breaks), (what, breaks)
        # The pieces before and after the ring call per attention layout, shared by the layers.
        assert counters["stats"]["unique_graphs"] <= 4, (what, dict(counters["stats"]))


def expert_parallel(model_dir: str) -> None:
    rank = dist.get_rank()
    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    models = []
    for compiled in (False, True):
        model = load_model(model_dir, head="lm", dtype=torch.float32, attention_backend="torch")
        shard_experts(model, mesh)
        if compiled:
            for layer in model.model.layers.values():
                parallelize_module.compile_block(layer, backend="aot_eager")
        models.append(model)
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + rank)  # each rank its own tokens
        ids = torch.randint(3, models[0].args.vocab_size, (2, 9 + 3 * step), generator=generator)
        logits = []
        for model in models:
            model.zero_grad()
            out = model(ids)
            out.pow(2).mean().backward()
            logits.append(out)
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5, msg="expert parallel")
        check_gradients(*models, "expert parallel")
    assert counters["stats"]["unique_graphs"] >= 1  # compiled, in pieces: the all-to-alls' splits are read on the host


def main() -> None:
    dist.init_process_group("gloo")
    parallelize_module.COMPILE_BACKEND = "aot_eager"  # what Inductor sees, without its code generation
    dense_dir, moe_dir = sys.argv[1:3]
    tensor_parallel(dense_dir)
    context_parallel(dense_dir, "ulysses", checkpointing=True)
    context_parallel(dense_dir, "ring", checkpointing=False)
    expert_parallel(moe_dir)
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
