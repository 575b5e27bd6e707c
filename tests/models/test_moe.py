"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): parity with ``transformers`` in float32 on both
expert compute paths, grouped GEMMs against the expert loop (outputs and gradients), the published per-expert
checkpoint layout read and written (whole, and sharded over 2 FSDP ranks), and the errors for a missing expert and
for tensor parallelism."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from hf_fixtures import MOE_FAMILIES, hf_config, padded_batch, write_hf_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torchrun_helpers import torchrun

from spmd_rlhf.models import (
    CheckpointMismatchError,
    ModelConfigError,
    args_from_hf_config,
    load_model,
    read_decoder_args,
    save_pretrained,
)
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.moe import MoEBlock, Routing, expert_load, grouped_mm_supported
from spmd_rlhf.models.parallelize import check_tensor_parallel

PUBLISHED_EXPERT = {
    "qwen3_moe": "model.layers.0.mlp.experts.{e}.{projection}.weight",
    "qwen2_moe": "model.layers.0.mlp.experts.{e}.{projection}.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.{e}.{projection}.weight",
}
PROJECTIONS = {
    "qwen3_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "qwen2_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    "mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
}


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def moe_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), write_hf_model(request.param, str(path))


def use_grouped_mm(model: torch.nn.Module, grouped: bool) -> None:
    for module in model.modules():
        if hasattr(module, "grouped_mm"):
            module.grouped_mm = grouped


def max_logit_difference(ours: DecoderLM, hf_model, path_inputs) -> float:
    input_ids, attention_mask, position_ids = path_inputs
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logits = ours(input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    return (logits[real] - expected[real]).abs().max().item()


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "looped"])
def test_logits_match_transformers_fp32(moe_checkpoint, grouped):
    family, path, hf_model = moe_checkpoint
    model = load_model(path, attention_backend="torch")
    assert grouped_mm_supported(torch.zeros(1), model.args.hidden_size, model.args.moe.moe_intermediate_size)
    use_grouped_mm(model, grouped)
    moe_layers = [index for index, layer in model.model.layers.items() if isinstance(layer.mlp, MoEBlock)]
    assert moe_layers == (["0", "2"] if family == "qwen3_moe" else ["0", "1"])  # qwen3_moe: mlp_only_layers=[1]
    assert max_logit_difference(model, hf_model, padded_batch(batch=3, seq=14, side="left")) <= 1e-5


def test_the_router_is_seen_by_a_hook_with_its_logits_and_expert_load(moe_checkpoint):
    _, path, _ = moe_checkpoint
    model = load_model(path, attention_backend="torch")
    seen: list[Routing] = []
    model.model.layers["0"].mlp.gate.register_forward_hook(lambda module, inputs, routing: seen.append(routing))
    with torch.no_grad():
        model(torch.arange(3, 15)[None])
    (routing,) = seen
    assert routing.logits.shape == (12, 4) and routing.experts.shape == routing.weights.shape == (12, 2)
    load = expert_load(routing, 4)
    assert load.sum() == 24 and load.max() < 24  # every token twice, not all on one expert


def test_grouped_mm_equals_the_expert_loop_with_gradients(tmp_path):
    """One Qwen2-MoE block (routed and shared experts) on 5 tokens, top-2 of 8 experts, so that some experts get no
    token: output and every gradient agree between the two paths."""
    write_hf_model("qwen2_moe", str(tmp_path), num_experts=8)
    args = read_decoder_args(str(tmp_path))
    torch.manual_seed(0)
    block = MoEBlock(args)
    x = torch.randn(1, 5, args.hidden_size)
    results = []
    for grouped in (True, False):
        block.experts.grouped_mm = grouped
        block.zero_grad()
        inputs = x.clone().requires_grad_()
        out = block(inputs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, inputs.grad, {name: param.grad.clone() for name, param in block.named_parameters()}))
    (grouped_out, grouped_input_grad, grouped_grads), (looped_out, looped_input_grad, looped_grads) = results
    assert (expert_load(block.gate(x.view(5, -1)), 8) == 0).any(), "the case needs an expert without tokens"
    torch.testing.assert_close(grouped_out, looped_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(grouped_input_grad, looped_input_grad, rtol=0, atol=1e-6)
    assert sorted(grouped_grads) == sorted(looped_grads)
    for name, grad in grouped_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, looped_grads[name], rtol=0, atol=1e-6, msg=name)


def test_experts_load_from_the_published_per_expert_tensors(moe_checkpoint):
    family, path, _ = moe_checkpoint
    model = load_model(path)
    stored = load_file(f"{path}/model.safetensors")
    experts = model.model.layers["0"].mlp.experts
    for ours, published in PROJECTIONS[family].items():
        parameter = getattr(experts, ours)
        assert parameter.shape[0] == 4 and parameter.dim() == 3
        for e in range(4):
            name = PUBLISHED_EXPERT[family].format(e=e, projection=published)
            assert torch.equal(parameter[e], stored[name]), name


def test_experts_load_from_transformers_fused_in_memory_layout(moe_checkpoint, tmp_path):
    """A transformers 5 model's own state dict (``experts.gate_up_proj`` fused, Mixtral's block named ``mlp``) saved
    as is loads to the same logits."""
    _, path, hf_model = moe_checkpoint
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    shutil.copy(f"{path}/config.json", tmp_path)
    model = load_model(str(tmp_path), attention_backend="torch")
    assert max_logit_difference(model, hf_model, padded_batch(batch=3, seq=14, side="left")) <= 1e-5


def test_export_writes_the_published_layout_and_transformers_reads_it(moe_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    _, path, _ = moe_checkpoint
    model = load_model(path, attention_backend="torch")
    save_pretrained(model, str(tmp_path))
    with (
        safe_open(f"{path}/model.safetensors", framework="pt") as source,
        safe_open(f"{tmp_path}/model.safetensors", framework="pt") as exported,
    ):
        assert sorted(exported.keys()) == sorted(source.keys())
        for name in source.keys():
            assert torch.equal(exported.get_tensor(name), source.get_tensor(name)), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert max_logit_difference(model, reloaded, padded_batch(batch=2, seq=10, side="right")) <= 1e-5


def test_a_missing_expert_tensor_is_one_error_naming_it(tmp_path):
    write_hf_model("mixtral", str(tmp_path))
    tensors = load_file(f"{tmp_path}/model.safetensors")
    missing = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del tensors[missing]
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=f"missing: {missing}$") as error:
        load_model(str(tmp_path))
    assert "\n" not in str(error.value)


def test_router_jitter_is_refused():
    with pytest.raises(ModelConfigError, match=r"^router_jitter_noise=0.1 is not supported"):
        args_from_hf_config(hf_config("mixtral", router_jitter_noise=0.1))


def test_tensor_parallelism_checks_the_expert_widths_it_splits(tmp_path):
    write_hf_model("qwen3_moe", str(tmp_path), vocab_size=102)
    args = read_decoder_args(str(tmp_path))
    with torch.device("meta"):
        model = DecoderLM(args)
    check_tensor_parallel(model, 2, role="actor")
    odd = dataclasses.replace(args, moe=dataclasses.replace(args.moe, moe_intermediate_size=31))
    with torch.device("meta"):
        model = DecoderLM(odd)
    with pytest.raises(ValueError, match=r"^actor\.tp=2 does not divide the model's moe_intermediate_size=31; choose"):
        check_tensor_parallel(model, 2, role="actor")


def test_fsdp_on_one_and_two_ranks_loads_computes_and_saves_experts(tmp_path):
    """FSDP2 over 1 rank, and over 2 ranks that each hold half of the experts (``programs/moe_sharded.py`` checks the
    pieces, logits and expert gradients against one process); the streamed save equals transformers' checkpoint; and
    TP over 2 ranks (Qwen2-MoE: expert widths, the shared expert) gives the same logits and every gradient."""
    write_hf_model("qwen2_moe", str(tmp_path / "model"), vocab_size=102)  # TP splits the vocabulary
    finished = torchrun(
        "moe_sharded.py", str(tmp_path / "model"), str(tmp_path / "out"), nproc=2, timeout=120, forked=True
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    saved, source = load_file(f"{tmp_path}/out/model.safetensors"), load_file(f"{tmp_path}/model/model.safetensors")
    assert sorted(saved) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("ep", [2])  # ep = 4 runs in the roles' parity test (tests/workers)
def test_expert_parallel_layer_and_model_equal_one_process(tmp_path, ep):
    """``programs/expert_parallel.py``: each rank's own tokens through its ``E / ep`` experts by all-to-all, against
    the whole layer in one process (outputs, input gradients, each expert's gradient summed over ranks; grouped and
    looped), and a tiny Qwen3-MoE model with every layer's experts sharded against the unsharded model."""
    from spmd_rlhf.tiny.model import make_tiny

    model_dir = make_tiny(family="qwen3_moe", out_dir=str(tmp_path / "model"), num_experts=8)
    finished = torchrun("expert_parallel.py", model_dir, nproc=ep, timeout=180, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]


def test_all_to_all_bytes_under_uniform_routing():
    from spmd_rlhf.models.expert_parallel import all_to_all_bytes

    # 1024 tokens x 8 copies of 2048 bf16 elements, 3 of 4 bound for another rank.
    assert all_to_all_bytes(tokens=1024, top_k=8, hidden=2048, ep=4, dtype_bytes=2) == 1024 * 8 * 2048 * 2 * 3 / 4
    assert all_to_all_bytes(tokens=1024, top_k=8, hidden=2048, ep=1, dtype_bytes=2) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_experts_grouped_equal_looped_and_the_model_runs():
    """On CUDA in bfloat16: whether ``torch._grouped_mm`` serves (sm90 / sm100), its outputs and gradients against
    the expert loop's, and a tiny Qwen3-MoE forward + backward with the path the layer picks."""
    from spmd_rlhf.models.moe import Experts, TopKRouter

    device = torch.device("cuda")
    torch.manual_seed(0)
    with device:
        router = TopKRouter(256, 16, top_k=4, renormalize=True).to(torch.bfloat16).requires_grad_(False)
        experts = Experts(16, 256, 128).to(torch.bfloat16)
        x = torch.randn(300, 256, dtype=torch.bfloat16)
    grouped = grouped_mm_supported(x, 256, 128)
    print(f"grouped_mm on {torch.cuda.get_device_name()}: {grouped}")
    results = []
    for path in [True, False] if grouped else [False]:
        experts.grouped_mm = path
        experts.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_(True)
        out = experts(inputs, router(inputs))
        out.float().square().mean().backward()
        results.append([out, inputs.grad, experts.gate_proj.grad, experts.down_proj.grad])
    if grouped:
        for mine, theirs in zip(*results):
            torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-2)
    config = hf_config("qwen3_moe")
    with device:
        model = DecoderLM(args_from_hf_config(config)).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 33), device=device)
    model(ids).float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
