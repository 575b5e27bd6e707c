"""The engine on CUDA: SDPA over gathered blocks, and flash-attn's paged kernel when installed (skipped without
CUDA)."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.models import load_model, log_probs_from_logits
from spmd_rlhf.models.attention import FLASH_PAGED_BLOCK_MULTIPLE, flash_attn_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [70, 71, 72]]


def _max_log_prob_error(model, outputs, temperature: float) -> float:
    errors = []
    for seq in outputs:
        ids = torch.tensor([seq.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids)
        expected = log_probs_from_logits(logits[:, :-1], ids[:, 1:], temperature=temperature)
        expected = expected[0, seq.num_prompt_tokens - 1 :]
        errors.append((torch.tensor(seq.log_probs) - expected.cpu()).abs().max().item())
    return max(errors)


def test_float32_cuda_engine_matches_cpu_greedy_and_training_log_probs(tmp_path):
    write_hf_model("llama3", str(tmp_path))
    params = SamplingParams(temperature=0, max_new_tokens=10)
    on_cpu = LLMEngine(load_model(str(tmp_path)), eos_token_id=None, block_size=4).generate(PROMPTS, params)
    model = load_model(str(tmp_path), device="cuda", attention_backend="sdpa")
    on_gpu = LLMEngine(model, eos_token_id=None, block_size=4, num_blocks=8).generate(PROMPTS, params)
    assert [seq.generated_token_ids for seq in on_gpu] == [seq.generated_token_ids for seq in on_cpu]
    assert _max_log_prob_error(model, on_gpu, 1.0) < 1e-4


@pytest.mark.skipif(not flash_attn_available(), reason="needs flash-attn")
def test_flash_paged_kernel_log_probs_match_training_in_bf16(tmp_path):
    write_hf_model("qwen2_untied", str(tmp_path))
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda", attention_backend="flash")
    engine = LLMEngine(model, eos_token_id=None)  # the default block size under flash-attn takes its paged kernel
    assert engine.block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0
    outputs = engine.generate(PROMPTS * 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=0))
    assert _max_log_prob_error(model, outputs, 1.0) < 5e-2
