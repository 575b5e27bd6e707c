"""GPU checks of the attention backends in 16-bit (skipped without CUDA; CI is CPU-only)."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import padded_batch, write_hf_model

from spmd_rlhf.models import load_model
from spmd_rlhf.models.attention import flash_attn_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_BACKENDS = ["sdpa", "torch"] + (["flash"] if flash_attn_available() else [])


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_bf16_cuda_logits_match_float32_cpu(tmp_path, backend, side):
    write_hf_model("qwen2_tied", str(tmp_path))
    input_ids, attention_mask, _ = padded_batch(batch=3, seq=14, side=side)
    with torch.no_grad():
        reference = load_model(str(tmp_path))(input_ids, attention_mask=attention_mask)
        model = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda", attention_backend=backend)
        ours = model(input_ids.cuda(), attention_mask=attention_mask.cuda()).float().cpu()
    real = attention_mask.bool()
    torch.testing.assert_close(ours[real], reference[real], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_packed_equals_separate_on_cuda(tmp_path, backend):
    write_hf_model("llama3", str(tmp_path))
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device="cuda", attention_backend=backend)
    sequences = [torch.arange(3, 3 + length, device="cuda") for length in (5, 9)]
    with torch.no_grad():
        packed = model(torch.cat(sequences)[None], cu_seqlens=torch.tensor([0, 5, 14], device="cuda"))[0]
        separate = torch.cat([model(seq[None])[0] for seq in sequences])
    torch.testing.assert_close(packed.float(), separate.float(), atol=3e-2, rtol=3e-2)
