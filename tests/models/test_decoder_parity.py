"""Logit / value / score parity with ``transformers`` for every supported family, padded and packed."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import FAMILIES, padded_batch, write_hf_model

from spmd_rlhf.models import load_model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), write_hf_model(request.param, str(path))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_logits_match_transformers_fp32(family_checkpoint, side, backend):
    _, path, hf_model = family_checkpoint
    input_ids, attention_mask, position_ids = padded_batch(batch=3, seq=14, side=side)
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = load_model(path, attention_backend=backend)(input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    assert ours.shape == expected.shape
    assert (ours[real] - expected[real]).abs().max().item() <= 1e-5


def test_logits_match_transformers_bf16(family_checkpoint):
    _, path, _ = family_checkpoint
    from transformers import AutoModelForCausalLM

    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    input_ids, attention_mask, position_ids = padded_batch(batch=2, seq=12, side="left")
    with torch.no_grad():
        expected = hf_bf16(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = load_model(path, dtype=torch.bfloat16, attention_backend="torch")(
            input_ids, attention_mask=attention_mask
        )
    real = attention_mask.bool()
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours[real].float(), expected[real].float(), atol=2e-2, rtol=2e-2)


def test_packed_equals_separate_forwards(family_checkpoint):
    _, path, _ = family_checkpoint
    model = load_model(path)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 101, (length,), generator=generator) for length in (5, 9, 3)]
    cu_seqlens = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    restarting_positions = torch.cat([torch.arange(len(seq)) for seq in sequences])[None]
    with torch.no_grad():
        packed = model(torch.cat(sequences)[None], cu_seqlens=cu_seqlens)[0]
        packed_by_positions = model(torch.cat(sequences)[None], position_ids=restarting_positions)[0]
        separate = torch.cat([model(seq[None])[0] for seq in sequences])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_by_positions, packed, atol=0, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_score_head_matches_sequence_classification(tmp_path, side):
    hf_model = write_hf_model("qwen2_untied", str(tmp_path), kind="score")
    input_ids, attention_mask, position_ids = padded_batch(batch=3, seq=10, side=side)
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = load_model(str(tmp_path), head="score")(input_ids, attention_mask=attention_mask)
    assert ours.shape == (3,)
    torch.testing.assert_close(ours, expected.squeeze(-1), atol=1e-5, rtol=0)


def test_score_head_packed_reads_each_sequence_last_token(tmp_path):
    write_hf_model("llama3", str(tmp_path), kind="score")
    model = load_model(str(tmp_path), head="score")
    first, second = torch.arange(3, 10), torch.arange(20, 24)
    with torch.no_grad():
        packed = model(torch.cat([first, second])[None], cu_seqlens=torch.tensor([0, 7, 11]))
        by_positions = model(
            torch.cat([first, second])[None], position_ids=torch.cat([torch.arange(7), torch.arange(4)])[None]
        )
        separate = torch.cat([model(first[None]), model(second[None])])
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=0)
    torch.testing.assert_close(by_positions, packed, atol=0, rtol=0)


def test_value_head_matches_token_classification(tmp_path):
    hf_model = write_hf_model("qwen3", str(tmp_path), kind="value")
    input_ids, attention_mask, position_ids = padded_batch(batch=2, seq=9, side="right")
    with torch.no_grad():
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        ours = load_model(str(tmp_path), head="value")(input_ids, attention_mask=attention_mask)
    real = attention_mask.bool()
    assert ours.shape == (2, 9)
    torch.testing.assert_close(ours[real], expected.squeeze(-1)[real], atol=1e-5, rtol=0)


def test_value_head_from_causal_lm_checkpoint_starts_at_zero(tmp_path):
    write_hf_model("qwen2_untied", str(tmp_path))
    critic = load_model(str(tmp_path), head="value")
    assert torch.count_nonzero(critic.score.weight) == 0 and torch.count_nonzero(critic.score.bias) == 0
    values = critic(torch.arange(3, 11)[None])
    assert values.shape == (1, 8) and torch.count_nonzero(values) == 0
    values.sum().backward()
    assert critic.score.weight.grad.abs().sum() > 0


def test_default_position_ids_skip_left_padding(tmp_path):
    write_hf_model("mistral", str(tmp_path))
    model = load_model(str(tmp_path))
    input_ids, attention_mask, position_ids = padded_batch(batch=3, seq=12, side="left")
    with torch.no_grad():
        implicit = model(input_ids, attention_mask=attention_mask)
        explicit = model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
    torch.testing.assert_close(implicit, explicit, atol=0, rtol=0)


def test_padded_and_packed_inputs_together_are_rejected(tmp_path):
    write_hf_model("qwen2_tied", str(tmp_path))
    model = load_model(str(tmp_path))
    with pytest.raises(ValueError, match="either attention_mask"):
        model(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4), cu_seqlens=torch.tensor([0, 4]))
