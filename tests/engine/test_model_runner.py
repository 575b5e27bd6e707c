"""ModelRunner: prefill and decode logits on the paged cache equal a plain forward; cache sizing and release."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.model_runner import ModelRunner
from spmd_rlhf.engine.sequence import SamplingParams, Sequence
from spmd_rlhf.models import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    write_hf_model("qwen3", path)
    return load_model(path, head="lm", dtype=torch.float32)


def test_prefill_and_decode_logits_equal_a_full_forward(model, monkeypatch):
    """Prefill and decode logits on the paged cache equal a full forward, and each eager step's inputs reach the
    device in one move (one pinned copy to a GPU)."""
    import spmd_rlhf.engine.model_runner as model_runner

    moves, real = [], model_runner.to_device_together
    monkeypatch.setattr(
        model_runner, "to_device_together", lambda tensors, device: moves.append(set(tensors)) or real(tensors, device)
    )
    runner = ModelRunner(model, block_size=4)
    runner.allocate_cache(16)
    manager = BlockManager(16, 4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 10, 12, 13, 14], [40, 41]]
    seqs = [Sequence(i, prompt, SamplingParams(), eos_token_id=None) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        assert manager.try_allocate(seq)
    assert seqs[1].num_cached_tokens == 4  # its first block is the first sequence's, written in the same step

    def expected_last_logits() -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([model(torch.tensor([seq.token_ids]))[0, -1] for seq in seqs])

    torch.testing.assert_close(runner.run(seqs, is_prefill=True), expected_last_logits(), atol=1e-5, rtol=0)
    for step in range(3):
        for seq in seqs:
            seq.append(20 + step, 0.0, 0.0)
            assert manager.append_slot(seq)
        torch.testing.assert_close(runner.run(seqs, is_prefill=False), expected_last_logits(), atol=1e-5, rtol=0)
    inputs = {"token_ids", "positions", "slot_mapping", "block_tables", "context_lens", "cu_seqlens_q"}
    assert moves == [inputs] * 4


def test_cache_sizing_reuse_and_release(model):
    runner = ModelRunner(model, block_size=8)
    args = model.args
    assert runner.block_bytes == 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4 * 8
    assert runner.blocks_for_bytes(3 * runner.block_bytes + 1) == 3
    with pytest.raises(ValueError, match="less than one KV block"):
        runner.blocks_for_bytes(runner.block_bytes - 1)
    runner.allocate_cache(6)
    runner.allocate_cache(2)
    assert runner.num_blocks == 6, "a big enough cache is kept"
    runner.free_cache()
    assert runner.num_blocks == 0


def test_a_model_without_lm_head_is_refused(tmp_path):
    write_hf_model("llama3", str(tmp_path), kind="score")
    with pytest.raises(ValueError, match="LM head, got head='score'"):
        ModelRunner(load_model(str(tmp_path), head="score"), block_size=4)
