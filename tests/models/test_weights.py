"""Hugging Face directory I/O: round trips through transformers, sharding, and one error listing every mismatch."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_fixtures import padded_batch, write_hf_model
from safetensors.torch import load_file, save_file

from spmd_rlhf.models import CheckpointMismatchError, load_model, save_pretrained


def _logits(model, input_ids, attention_mask, position_ids):
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("family", ["qwen2_tied", "llama3", "qwen3"])
@pytest.mark.parametrize("max_shard_bytes", [5 * 1024**3, 40_000])
def test_save_then_transformers_load_gives_same_logits(tmp_path, family, max_shard_bytes):
    from transformers import AutoModelForCausalLM

    write_hf_model(family, str(tmp_path / "src"))
    ours = load_model(str(tmp_path / "src"))
    written = save_pretrained(ours, str(tmp_path / "out"), max_shard_bytes=max_shard_bytes)
    sharded = max_shard_bytes < 1e6
    assert os.path.isfile(tmp_path / "out" / "model.safetensors.index.json") == sharded
    assert sum(path.endswith(".safetensors") for path in written) > 1 if sharded else 1
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    batch = padded_batch(batch=2, seq=10, side="left")
    real = batch[1].bool()
    assert (_logits(reloaded, *batch)[real] - _logits(ours, *batch)[real]).abs().max() <= 1e-5
    # And back through our loader from the (possibly sharded) directory.
    again = load_model(str(tmp_path / "out"))
    torch.testing.assert_close(_logits(again, *batch), _logits(ours, *batch), atol=0, rtol=0)


def test_tied_checkpoint_is_saved_without_lm_head_copy(tmp_path):
    write_hf_model("qwen2_tied", str(tmp_path / "src"))
    model = load_model(str(tmp_path / "src"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_pretrained(model, str(tmp_path / "out"))
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))


@pytest.mark.parametrize(
    "head,architecture", [("score", "ForSequenceClassification"), ("value", "ForTokenClassification")]
)
def test_score_and_value_heads_save_as_transformers_classifiers(tmp_path, head, architecture):
    import transformers

    hf_model = write_hf_model("llama3", str(tmp_path / "src"), kind=head)
    ours = load_model(str(tmp_path / "src"), head=head)
    save_pretrained(ours, str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Llama" + architecture] and len(config["id2label"]) == 1
    reloaded = (
        getattr(transformers, "Llama" + architecture)
        .from_pretrained(str(tmp_path / "out"), attn_implementation="eager")
        .eval()
    )
    batch = padded_batch(batch=2, seq=8, side="right")
    torch.testing.assert_close(_logits(reloaded, *batch), _logits(hf_model, *batch), atol=1e-6, rtol=0)


def test_tokenizer_is_saved_alongside(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    write_hf_model("mistral", str(tmp_path / "src"))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    )
    save_pretrained(load_model(str(tmp_path / "src")), str(tmp_path / "out"), tokenizer=tokenizer)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_mismatches_are_reported_together(tmp_path):
    write_hf_model("llama3", str(tmp_path))
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.extra.weight"] = torch.zeros(2)
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointMismatchError) as error:
        load_model(str(tmp_path))
    message = str(error.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.extra.weight" in message
    assert "wrong shape: model.norm.weight (checkpoint [7], model [64])" in message


def test_score_head_needs_score_weights(tmp_path):
    write_hf_model("qwen2_untied", str(tmp_path))
    with pytest.raises(CheckpointMismatchError, match=r"missing: score\.weight; unexpected: lm_head\.weight"):
        load_model(str(tmp_path), head="score")


def test_pytorch_bin_checkpoints_are_refused_with_a_hint(tmp_path):
    write_hf_model("qwen2_untied", str(tmp_path))
    os.rename(tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        load_model(str(tmp_path))


def test_loaded_model_has_no_meta_tensors_and_requested_dtype(tmp_path):
    write_hf_model("qwen3", str(tmp_path))
    model = load_model(str(tmp_path), dtype="bfloat16")
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.inv_freq.dtype == torch.float32


def test_model_survives_overwriting_its_own_checkpoint(tmp_path):
    write_hf_model("qwen3", str(tmp_path))
    model = load_model(str(tmp_path))
    batch = padded_batch(batch=2, seq=6, side="right")
    before = _logits(model, *batch)
    save_pretrained(model, str(tmp_path), max_shard_bytes=10**9)
    torch.testing.assert_close(_logits(model, *batch), before, atol=0, rtol=0)
    torch.testing.assert_close(_logits(load_model(str(tmp_path)), *batch), before, atol=0, rtol=0)
