"""Compiled decoder blocks (``parallelize.compile_block``, ``model.compile``): the same numbers as eager, one graph
per attention layout and grad mode whatever the packed lengths, no graph break. Inductor on CPU needs a C++ compiler;
the layout counts trace with ``aot_eager`` (TorchDynamo and AOTAutograd as Inductor sees them, without its code
generation, which costs seconds a graph on CPU)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from dynamo_checks import restarted_analyses
from hf_fixtures import write_hf_model
from torch._dynamo.utils import compilation_time_metrics, counters
from torchrun_helpers import torchrun

from spmd_rlhf.models import attention, load_model
from spmd_rlhf.models.parallelize import compile_block, compiles_blocks


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def eager_and_compiled(tmp_path, family: str, *, dtype: torch.dtype, backend: str):
    path = str(tmp_path / "m")
    write_hf_model(family, path)
    eager = load_model(path, head="lm", dtype=dtype)
    compiled = load_model(path, head="lm", dtype=dtype)
    for layer in compiled.model.layers.values():
        compile_block(layer, backend=backend)
    return eager, compiled


def packed(rng: random.Random, vocab: int, lengths: list[int]) -> dict:
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(sum(lengths))]])
    return {"input_ids": ids, "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths)}


def check_train_step(eager, compiled, inputs: dict) -> None:
    for model in (eager, compiled):
        model.zero_grad()
        model(**inputs).pow(2).mean().backward()
    torch.testing.assert_close(compiled(**inputs), eager(**inputs), rtol=1e-5, atol=1e-5)
    for (name, ours), theirs in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_inductor_blocks_equal_eager_over_random_packed_lengths(tmp_path, fresh_dynamo):
    """Qwen2 (q/k/v bias) with every block through Inductor: logits and gradients equal eager's for packed rows of
    random lengths and sequence counts, from one graph (every block shares one code object and one set of guards)."""
    eager, compiled = eager_and_compiled(tmp_path, "qwen2_untied", dtype=torch.float32, backend="inductor")
    rng = random.Random(0)
    for _ in range(4):
        count = rng.randint(2, 5)
        check_train_step(eager, compiled, packed(rng, eager.args.vocab_size, [rng.randint(16, 24)] * count))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
    assert not restarted_analyses()


def test_compiled_blocks_trace_once_per_attention_layout_and_grad_mode(tmp_path, fresh_dynamo):
    """Per-sequence rows (similar lengths), one masked attention (one long sequence beside short ones; a lone sequence
    too), with and without grad: four graphs, however many random packed rows follow; no graph break."""
    eager, compiled = eager_and_compiled(tmp_path, "qwen2_untied", dtype=torch.float32, backend="aot_eager")
    rng = random.Random(0)
    vocab = eager.args.vocab_size
    batches = [[12, 14, 9], [40, 2, 3], [17]] + [
        [rng.randint(2, 40) for _ in range(rng.randint(1, 5))] for _ in range(7)
    ]
    for lengths in batches:
        check_train_step(eager, compiled, packed(rng, vocab, lengths))
    with torch.no_grad():
        for lengths in ([12, 14, 9], [40, 2, 3], [5, 6], [33, 1, 2, 2]):
            inputs = packed(rng, vocab, lengths)
            torch.testing.assert_close(compiled(**inputs), eager(**inputs), rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 4
    assert not restarted_analyses()  # the softmax scale is a constant to the graph, not a symbolic input


def test_long_packed_rows_trace_once_however_many_length_classes_they_span(tmp_path, fresh_dynamo, monkeypatch):
    """Rows over MASK_TOKEN_LIMIT (here 0: every row) attend per power-of-two length class, as many buckets as the
    row's lengths span: one graph per grad mode whatever the count, no graph break, outputs and gradients equal to
    eager blocks'. (Session 49's H200 run: each new count recompiled every block, about 8 s a time, in the reference
    and the update of an RL step.)"""
    monkeypatch.setattr(attention, "MASK_TOKEN_LIMIT", 0)
    eager, compiled = eager_and_compiled(tmp_path, "qwen2_untied", dtype=torch.float32, backend="aot_eager")
    rng = random.Random(0)
    vocab = eager.args.vocab_size
    for lengths in ([3, 5, 9], [2, 3, 5, 9, 17], [4, 6]):  # 3, 5 and 2 classes
        check_train_step(eager, compiled, packed(rng, vocab, lengths))
    with torch.no_grad():
        inputs = packed(rng, vocab, [2, 5, 9, 33])
        torch.testing.assert_close(compiled(**inputs), eager(**inputs), rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2
    assert not restarted_analyses()


def test_a_compiled_mixture_of_experts_block_has_no_graph_break_on_grouped_gemms(tmp_path, fresh_dynamo):
    """bfloat16, where grouped GEMMs serve (also under compile): one graph per kind of block, no break."""
    eager, compiled = eager_and_compiled(tmp_path, "qwen3_moe", dtype=torch.bfloat16, backend="aot_eager")
    rng = random.Random(0)
    for lengths in ([12, 14, 9], [20, 8, 11]):
        inputs = packed(rng, eager.args.vocab_size, lengths)
        torch.testing.assert_close(compiled(**inputs), eager(**inputs), rtol=0.02, atol=0.02)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2  # the MoE blocks' graph and the dense block's (mlp_only_layers)
    assert not restarted_analyses()


def test_model_compile_auto_compiles_on_a_gpu():
    decide = {
        (setting, on_gpu): compiles_blocks(setting, on_gpu=on_gpu)
        for setting in ("auto", "on", "off")
        for on_gpu in (False, True)
    }
    assert {key for key, compiles in decide.items() if compiles} == {("auto", True), ("on", False), ("on", True)}


def test_compiled_blocks_under_tensor_context_and_expert_parallelism_equal_eager(tmp_path):
    """2 gloo ranks (``programs/compiled_parallel_blocks.py``): tensor parallelism under FSDP2 and Ulysses inside
    selective activation checkpointing (no graph break), ring attention (the graph broken only at its
    exchanges) and expert parallelism, each compiled model's outputs and every gradient equal to eager blocks'."""
    dense, moe = str(tmp_path / "dense"), str(tmp_path / "moe")
    write_hf_model("qwen3", dense, vocab_size=128)  # tp = 2 splits the vocabulary
    write_hf_model("qwen3_moe", moe)
    finished = torchrun("compiled_parallel_blocks.py", dense, moe, nproc=2, timeout=240, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]


def test_compiled_blocks_under_fsdp_equal_eager(tmp_path, fresh_dynamo):
    """FSDP2 on a one-rank gloo group, as a role at dp = 1 runs: its parameters reach the compiled block as inputs with
    symbolic sizes (the head counts too); logits and gradients equal an eager FSDP model's."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rlhf.models.parallelize import parallelize

    path = str(tmp_path / "m")
    write_hf_model("qwen2_untied", path)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        models = []
        for compiled in (False, True):
            model = load_model(path, head="lm", dtype=torch.float32)
            parallelize(model, tp_mesh=None, dp_mesh=mesh["dp"], compile_layers=compiled)
            models.append(model)
        for layer in models[1].model.layers.values():  # parallelize compiles with Inductor; trace only, as above
            compile_block(layer, backend="aot_eager")
        rng = random.Random(0)
        for lengths in ([12, 14, 9], [40, 2, 3], [7, 8]):
            check_train_step(*models, packed(rng, models[0].args.vocab_size, lengths))
        assert not counters["graph_break"]
        assert counters["stats"]["unique_graphs"] == 2
        assert not restarted_analyses()
    finally:
        if started:
            dist.destroy_process_group()


def test_the_tensor_parallel_sum_keeps_its_gradient_when_compiled(fresh_dynamo):
    """Megatron's ``g`` (``collectives.sum_over``, after every row-parallel layer of a TP block) compiled gives the
    eager gradient. Its in-place all-reduce on a clone left the output without one under torch 2.11's TorchDynamo:
    a compiled TP block's layers all got zero gradients (the GPU machines' torch; this CPU's 2.13 was right)."""
    from spmd_rlhf.collectives import sum_over

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gradients = []
        for compiled in (False, True):
            weight = torch.ones(8, 8, requires_grad=True)

            def loss(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
                return sum_over(torch.nn.functional.linear(x, weight), dist.group.WORLD).pow(2).sum()

            run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
            run(torch.arange(32.0).view(4, 8) / 32, weight).backward()
            gradients.append(weight.grad)
        assert gradients[0].abs().sum() > 0
        torch.testing.assert_close(gradients[1], gradients[0])
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inductor_blocks_equal_eager_in_bf16(tmp_path, fresh_dynamo):
    """What model.compile=auto does on a GPU: Inductor (Triton kernels) blocks of a bf16 model on CUDA, equal to eager
    within bf16 rounding, gradients included, without a graph break, one graph over random packed rows."""
    eager, compiled = eager_and_compiled(tmp_path, "qwen2_untied", dtype=torch.bfloat16, backend="inductor")
    eager, compiled = eager.cuda(), compiled.cuda()
    rng = random.Random(0)
    for _ in range(2):
        inputs = packed(rng, eager.args.vocab_size, [rng.randint(16, 24)] * rng.randint(2, 5))
        inputs = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
        outputs = []
        for model in (eager, compiled):
            model.zero_grad()
            logits = model(**inputs)
            logits.float().pow(2).mean().backward()
            outputs.append(logits.float())
        torch.testing.assert_close(outputs[1], outputs[0], rtol=0.05, atol=0.05)
        for (name, ours), theirs in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(ours.grad.float(), theirs.grad.float(), rtol=0.1, atol=0.02, msg=name)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1
