"""Sequence parallelism (``parallelize(sequence_parallel=True)``, ``models.tp_plan``) over every rank of a gloo job
as its TP group, against the same TP split without it on the same rank: packed rows whose lengths are not multiples
of tp (padded inside the model) and a single sequence without offsets; a Llama with biases on its row-parallel layers
and a value head, every weight trained, eager (the bytes autograd saves for the backward smaller too), and a Qwen3
(per-head q/k norms, tied vocabulary) with LoRA adapters on every projection, eager and with compiled blocks: outputs
and every gradient equal; and a Qwen2-MoE (a shared expert, the routed experts' widths split over tp), eager, every
weight trained, whose routers see the row's real tokens only and replay routes given for them. Padded rows are refused,
naming the setting. (Every role's full update under it against one rank: tests/workers/test_parallel_parity.py.)

    torchrun --nproc-per-node 2 tests/models/programs/sequence_parallel.py QWEN3_DIR LLAMA_VALUE_DIR MOE_DIR
"""

import functools
import itertools
import sys

import torch
import torch.distributed as dist
from dynamo_checks import restarted_analyses
from lora_weights import randomize_adapters
from torch._dynamo.utils import compilation_time_metrics, counters
from torch.distributed.device_mesh import init_device_mesh

from spmd_rlhf.config import LoRAConfig
from spmd_rlhf.metrics.peak_memory import saved_activation_bytes
from spmd_rlhf.models import load_model
from spmd_rlhf.models import parallelize as parallelize_module
from spmd_rlhf.models.moe import TopKRouter
from spmd_rlhf.runtime import end_process

ROWS = ([12, 14, 9], [20, 4, 6, 2, 1], [31])
"""Packed rows of 35, 33 and 31 tokens: each padded by one token at tp = 2."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def built(model_dir: str, head: str, mesh, *, sequence_parallel: bool, compiled: bool = False, lora: bool = False):
    model = load_model(model_dir, head=head, dtype=torch.float32)
    adapters = parallelize_module.parallelize(
        model,
        tp_mesh=mesh,
        dp_mesh=None,
        sequence_parallel=sequence_parallel,
        compile_layers=compiled,
        lora=LoRAConfig(rank=4, alpha=8.0) if lora else None,
    )
    if lora:
        randomize_adapters(model, adapters)
    return model


def check_family(model_dir: str, head: str, mesh, *, lora: bool = False, compile_too: bool = True) -> None:
    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    plain = built(model_dir, head, mesh, sequence_parallel=False, lora=lora)
    split = built(model_dir, head, mesh, sequence_parallel=True, lora=lora)
    compiled = built(model_dir, head, mesh, sequence_parallel=True, compiled=True, lora=lora) if compile_too else None
    models = tuple(model for model in (plain, split, compiled) if model is not None)
    generator = torch.Generator().manual_seed(0)  # the same rows on every rank
    vocab = plain.args.vocab_size
    batches = [
        {
            "input_ids": torch.randint(3, vocab, (1, sum(lengths)), generator=generator),
            "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
            "max_seqlen": max(lengths),
        }
        for lengths in ROWS
    ]
    batches.append({"input_ids": torch.randint(3, vocab, (1, 17), generator=generator)})  # one sequence, no offsets
    # Compiled, one row: each attention layout (per-sequence rows, a masked row, one causal sequence) is a graph more.
    for inputs in batches[:1] if compiled is not None else batches:
        outputs = []
        for model in models:
            model.zero_grad()
            out = model(**inputs)
            out.pow(2).mean().backward()
            outputs.append(out)
        for name, out, model in zip(("eager", "compiled"), outputs[1:], models[1:]):
            what = f"{model_dir} {head} {name}"
            torch.testing.assert_close(out, outputs[0], rtol=1e-5, atol=1e-6, msg=what)
            for (param_name, theirs), ours in zip(plain.named_parameters(), model.parameters()):
                if theirs.grad is None:  # LoRA's frozen base
                    assert ours.grad is None, param_name
                    continue
                torch.testing.assert_close(
                    local(ours.grad), local(theirs.grad), rtol=1e-5, atol=1e-6, msg=f"{what} {param_name}"
                )
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One trace per graph: a float input that an operator specialises (LoRA's dropout probability) would restart it.
    assert not restarted_analyses(), restarted_analyses()
    if lora:
        return
    inputs = batches[0]
    with_split, without = (
        saved_activation_bytes(model, functools.partial(model, **inputs)) for model in (split, plain)
    )
    assert with_split < without, (with_split, without)
    if dist.get_rank() == 0:
        print(f"{head}: saved for the backward {with_split} bytes with sequence parallelism, {without} without")


def check_moe_routing(moe_dir: str, mesh) -> None:
    """Under sequence parallelism the routers route the row's real tokens, not its padding: forward hooks (the router
    losses, route recording) see what they see without it, and replayed routes of the real tokens apply."""
    plain, split = (built(moe_dir, "lm", mesh, sequence_parallel=flag) for flag in (False, True))
    lengths = ROWS[0]
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "input_ids": torch.randint(3, plain.args.vocab_size, (1, sum(lengths)), generator=generator),
        "cu_seqlens": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32),
    }
    seen = {id(model): [] for model in (plain, split)}
    routers = {id(model): [m for m in model.modules() if isinstance(m, TopKRouter)] for model in (plain, split)}
    for key, modules in routers.items():
        for router in modules:
            router.register_forward_hook(lambda module, args, routing, key=key: seen[key].append(routing))
    with torch.no_grad():
        plain(**inputs), split(**inputs)
    assert len(seen[id(plain)]) == len(seen[id(split)]) > 0
    for ours, theirs in zip(seen[id(split)], seen[id(plain)]):
        assert ours.experts.shape == (sum(lengths), plain.args.moe.num_experts_per_tok), ours.experts.shape
        assert torch.equal(ours.experts, theirs.experts)
        torch.testing.assert_close(ours.logits, theirs.logits, rtol=1e-5, atol=1e-6)
    replay = torch.randint(0, plain.args.moe.num_experts, (sum(lengths), plain.args.moe.num_experts_per_tok))
    replay[::3] = -1  # some tokens keep the router's own choice
    outputs = []
    for model in (plain, split):
        for router in routers[id(model)]:
            router.replay = replay
        with torch.no_grad():
            outputs.append(model(**inputs))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def check_refusals(dense_dir: str, mesh) -> None:
    model = built(dense_dir, "lm", mesh, sequence_parallel=True)
    try:
        model(torch.ones(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 8, dtype=torch.long))
        raise AssertionError("padded rows accepted")
    except ValueError as error:
        assert "sequence parallelism splits one packed row" in str(error), error


def main() -> None:
    dist.init_process_group("gloo")
    parallelize_module.COMPILE_BACKEND = "aot_eager"  # what Inductor sees, without its code generation
    qwen3_dir, llama_dir, moe_dir = sys.argv[1:4]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    # Every weight trained, eagerly: the norms' and row biases' gradients summed over tp, a value head.
    check_family(llama_dir, "value", mesh, compile_too=False)
    # Tied vocabulary, q/k norms and LoRA adapters on every projection (column and row), eager and compiled.
    check_family(qwen3_dir, "lm", mesh, lora=True)
    # Mixture-of-experts layers with a shared expert, every weight trained: the experts split their widths over tp.
    check_family(moe_dir, "lm", mesh, compile_too=False)
    check_moe_routing(moe_dir, mesh)
    check_refusals(qwen3_dir, mesh)
    dist.barrier()
    dist.destroy_process_group()
    end_process()  # no interpreter teardown (spmd_rlhf.runtime.end_process)


if __name__ == "__main__":
    main()
