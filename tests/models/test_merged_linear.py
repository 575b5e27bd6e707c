"""Merged q/k/v and gate/up projections (``merge_projections``, the generation copy's layout): the same outputs as the
unmerged model, the same parameter names and shapes, each layer's parameters views of the merged weight so that
writing them in place (as the reshard and the weight sync do) changes what the merged matmul computes; moving or
converting the model keeps that true; a trained or LoRA-adapted model is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_fixtures import padded_batch, write_hf_model

from spmd_rlhf.config import LoRAConfig
from spmd_rlhf.models import load_model
from spmd_rlhf.models.lora import apply_lora
from spmd_rlhf.models.merged_linear import MergeableProjections, merge_projections
from spmd_rlhf.models.moe import Experts, SwiGLU


@pytest.fixture(scope="module", params=["qwen2_tied", "qwen3", "qwen2_moe"])
def checkpoint(request, tmp_path_factory) -> str:
    """A float32 Hugging Face checkpoint: q/k/v biases (qwen2), q/k norms (qwen3), MoE layers with a shared expert
    beside dense ones (qwen2_moe)."""
    path = str(tmp_path_factory.mktemp(request.param))
    write_hf_model(request.param, path)
    return path


def _generation_copy(path: str, *, seed: int | None = None) -> torch.nn.Module:
    model = load_model(path, head="lm", dtype=torch.float32).requires_grad_(False).eval()
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    input_ids, attention_mask, _ = padded_batch(batch=3, seq=12, side="left")
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask)


def _in_merged_storage(param: torch.Tensor, module: MergeableProjections) -> bool:
    merged = module.merged.bias if param.dim() == 1 else module.merged.weight
    start = merged.untyped_storage().data_ptr()
    return start <= param.data_ptr() < start + merged.untyped_storage().nbytes()


def test_a_merged_model_computes_what_the_unmerged_one_does_under_the_same_names(checkpoint):
    model = _generation_copy(checkpoint)
    merged = copy.deepcopy(model)
    count = merge_projections(merged)
    layers = model.model.layers.values()
    swiglus = [module for module in model.modules() if isinstance(module, SwiGLU)]
    assert count == len(layers) + len(swiglus)
    shapes = {name: param.shape for name, param in model.named_parameters()}
    assert {name: param.shape for name, param in merged.named_parameters()} == shapes
    assert set(merged.state_dict()) == set(model.state_dict())
    for module in merged.modules():
        if isinstance(module, MergeableProjections):
            for name in module.MERGEABLE:
                for param in getattr(module, name).parameters():
                    assert _in_merged_storage(param, module), name
        if isinstance(module, Experts):  # routed experts keep their own 3-D weights
            assert all(param.is_contiguous() and param.storage_offset() == 0 for param in module.parameters())
    torch.testing.assert_close(_logits(merged), _logits(model), atol=1e-5, rtol=1e-5)


def _write_in_place(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """``source``'s values written into ``model``'s named parameters in two row bands each, as the weight sync writes
    its bands into a rank's piece."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            value, half = source.get_parameter(name), param.shape[0] // 2
            param[:half].copy_(value[:half])
            param[half:].copy_(value[half:])


def test_writing_the_named_parameters_in_place_changes_the_merged_forward(checkpoint):
    merged = _generation_copy(checkpoint)
    merge_projections(merged)
    before = _logits(merged)
    updated = _generation_copy(checkpoint, seed=1)
    _write_in_place(merged, updated)
    expected = _logits(updated)
    assert not torch.allclose(before, expected)
    torch.testing.assert_close(_logits(merged), expected, atol=1e-5, rtol=1e-5)


def test_converting_or_moving_a_merged_model_keeps_its_parameters_views_of_the_merged_weight(checkpoint):
    model, updated = _generation_copy(checkpoint), _generation_copy(checkpoint, seed=1)
    merged = copy.deepcopy(model)
    merge_projections(merged)
    merged.to(torch.float64)
    torch.testing.assert_close(_logits(merged), _logits(copy.deepcopy(model).double()), atol=1e-10, rtol=1e-10)
    _write_in_place(merged, updated)
    torch.testing.assert_close(_logits(merged), _logits(copy.deepcopy(updated).double()), atol=1e-10, rtol=1e-10)
    merged.to_empty(device="cpu")
    merged.reset_buffers()
    _write_in_place(merged, model)
    torch.testing.assert_close(_logits(merged), _logits(model.double()), atol=1e-10, rtol=1e-10)


def test_a_trained_or_adapted_model_is_refused(checkpoint):
    trained = load_model(checkpoint, head="lm", dtype=torch.float32)
    with pytest.raises(ValueError, match="trained"):
        merge_projections(trained)
    adapted = _generation_copy(checkpoint)
    apply_lora(adapted, LoRAConfig(rank=2), tp_mesh=None)
    adapted.requires_grad_(False)
    with pytest.raises(ValueError, match="LoRA"):
        merge_projections(adapted)
