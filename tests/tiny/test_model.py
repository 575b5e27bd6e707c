"""Tests for the tiny random-init model writer and its `spmd-rlhf make-tiny` / `make-task` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from spmd_rlhf.tiny.model import make_tiny

SOURCE_DIR = Path(__file__).resolve().parents[2] / "src"
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
TEXT = "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n and 1234 more  text\n"


@pytest.mark.parametrize("family", FAMILIES)
def test_make_tiny_writes_a_loadable_causal_lm(family, tmp_path):
    out_dir = str(tmp_path / family)
    assert make_tiny(family=family, out_dir=out_dir, hidden_size=32, num_heads=4, num_kv_heads=2) == out_dir
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config = model.config
    assert type(model).__name__ == FAMILIES[family]
    assert (Path(out_dir) / "model.safetensors").is_file()
    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    assert tokenizer.eos_token == "<|im_end|>"
    assert config.tie_word_embeddings == (family == "qwen2")
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (32, 4, 2)
    assert config.intermediate_size == 128
    assert getattr(config, "sliding_window", None) is None
    generation = json.loads((Path(out_dir) / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (tokenizer.eos_token_id, tokenizer.pad_token_id)

    # Whichever tokenizer class AutoTokenizer picks for the family (Qwen2Tokenizer for qwen2), ids match tokenizer.json.
    assert tokenizer.encode(TEXT) == Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json")).encode(TEXT).ids
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    logits = model(**prompt).logits
    assert logits.shape == (1, prompt["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_score_head_loads_as_sequence_classifier(tmp_path):
    make_tiny(family="qwen3", out_dir=str(tmp_path), head="score")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(model).__name__ == "Qwen3ForSequenceClassification"
    assert model.config.num_labels == 1
    batch = tokenizer(["3+4=7", "1+1=3 and more"], padding=True, return_tensors="pt")
    assert model(**batch).logits.shape == (2, 1)


def test_weights_are_seeded(tmp_path):
    def weights(name: str, seed: int) -> dict[str, torch.Tensor]:
        make_tiny(family="llama", out_dir=str(tmp_path / name), seed=seed)
        return load_file(tmp_path / name / "model.safetensors")

    first, again, other = weights("first", 0), weights("again", 0), weights("other", 1)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)
    assert (tmp_path / "first" / "tokenizer.json").read_text() == (tmp_path / "other" / "tokenizer.json").read_text()


def test_model_vocabulary_and_positions_can_exceed_the_tokenizer(tmp_path):
    from spmd_rlhf.models import load_model

    make_tiny(family="qwen2", out_dir=str(tmp_path), model_vocab_size=1000, max_position_embeddings=4096)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert len(tokenizer) < 1000
    assert (model.config.vocab_size, model.config.max_position_embeddings) == (1000, 4096)
    assert model.get_input_embeddings().weight.shape[0] == 1000
    assert load_model(str(tmp_path)).args.vocab_size == 1000


def test_tied_embeddings_follow_the_family_unless_given(tmp_path):
    """qwen2 ties by default (Qwen2.5-0.5B); an untied one (Qwen2.5-7B's layout) writes its own LM head."""
    make_tiny(family="qwen2", out_dir=str(tmp_path / "tied"))
    make_tiny(family="qwen2", out_dir=str(tmp_path / "untied"), tie_word_embeddings=False)
    tied, untied = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("tied", "untied"))
    assert "lm_head.weight" not in tied and "lm_head.weight" in untied
    assert json.loads((tmp_path / "untied" / "config.json").read_text())["tie_word_embeddings"] is False


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="allowed families: llama, qwen2, qwen3, mistral"):
        make_tiny(family="gpt2", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="allowed heads: lm, score"):
        make_tiny(family="llama", out_dir=str(tmp_path), head="value")
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        make_tiny(family="llama", out_dir=str(tmp_path), num_kv_heads=3)
    with pytest.raises(ValueError, match="model_vocab_size=10 is smaller than the tokenizer"):
        make_tiny(family="llama", out_dir=str(tmp_path), model_vocab_size=10)
    # A real vocabulary's size as the tokenizer's bound would give the model the corpus's few hundred rows.
    with pytest.raises(ValueError, match="pass model_vocab_size=151936"):
        make_tiny(family="qwen2", out_dir=str(tmp_path), vocab_size=151936)


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SOURCE_DIR)}
    return subprocess.run(
        [sys.executable, "-m", "spmd_rlhf.cli", *args], env=env, capture_output=True, text=True, timeout=120, check=True
    )


def test_cli_make_tiny_and_make_task(tmp_path, capsys):
    """make-tiny as a command of its own interpreter; make-task through the same entry in this process."""
    from spmd_rlhf.cli import main

    model_dir = tmp_path / "model"
    _run_cli(
        "make-tiny",
        "--family",
        "mistral",
        "--out",
        str(model_dir),
        "--hidden",
        "32",
        "--layers",
        "1",
        "--tokenizer-tasks",
        "arithmetic",
        "tool_products",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "MistralForCausalLM"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 1)
    # A tokenizer trained on the tool task's text too writes a calculator call in a few dozen tokens, not 77.
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*58"}}\n</tool_call>'
    assert len(AutoTokenizer.from_pretrained(model_dir).encode(call)) <= 30

    task_dir = tmp_path / "task"
    sizes = ["--train-size", "10", "--val-size", "5"]
    assert main(["make-task", "--task", "arithmetic", "--out", str(task_dir), *sizes]) == 0
    assert capsys.readouterr().out.count("wrote ") == 4
    assert len((task_dir / "val.jsonl").read_text().splitlines()) == 5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_make_tiny_loads_identically_in_transformers_and_spmd_rlhf(tmp_path, family):
    from spmd_rlhf.models import load_model

    make_tiny(family=family, out_dir=str(tmp_path), seed=3)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ours = load_model(str(tmp_path))
    prompts = [[{"role": "user", "content": "3+4="}], [{"role": "user", "content": "12+9="}]]
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = reference(**batch, position_ids=position_ids).logits
        logits = ours(batch["input_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert (logits[real] - expected[real]).abs().max() <= 1e-5


def test_make_tiny_on_the_command_line_takes_a_model_vocabulary_and_names_the_flag_when_it_is_missing(tmp_path, capsys):
    from spmd_rlhf.cli import main

    assert main(["make-tiny", "--family", "qwen2", "--out", str(tmp_path / "bad"), "--vocab-size", "151936"]) == 2
    assert "--model-vocab-size" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main(["make-tiny", "--family", "qwen2", "--out", str(tmp_path / "good"), "--model-vocab-size", "2000"]) == 0
    assert json.loads((tmp_path / "good" / "config.json").read_text())["vocab_size"] == 2000
