"""Exporting a mixture-of-experts role from its training checkpoint writes the published per-expert layout, which
``transformers`` loads back to the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spmd_rlhf import checkpoint
from spmd_rlhf.models import load_model
from spmd_rlhf.tiny.model import make_tiny


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_moe_role_exports_one_tensor_per_expert(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny(family="mixtral", out_dir=str(tmp_path / "model"), num_layers=1)
    model = load_model(model_dir, attention_backend="torch")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def save_actor(staging: Path) -> None:
        state_dir = checkpoint.role_state_dir(staging, "actor")
        checkpoint.save_role_state(state_dir, model=model, optimizer=optimizer, scheduler=scheduler, process_group=None)
        checkpoint.save_model_config(state_dir, model, tokenizer_path=model_dir)

    checkpoint.write_checkpoint(tmp_path / "run" / "step_1", save_actor, trainer_state={"step": 1, "recipe": "test"})
    exported = checkpoint.export_hf(tmp_path / "run", tmp_path / "export", bucket_bytes=2**16)["actor"]
    source, written = load_file(f"{model_dir}/model.safetensors"), load_file(f"{exported}/model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in written
    assert sorted(written) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(written[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(ids), rtol=0, atol=1e-5)
