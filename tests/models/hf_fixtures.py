"""Small random Hugging Face checkpoints for every supported family, written with ``transformers`` itself."""

from __future__ import annotations

import torch

FAMILIES = {
    # Llama 3: GQA, llama3 rope scaling that actually bends frequencies at these lengths, untied.
    "llama3": dict(
        model_type="llama",
        num_key_value_heads=2,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Llama 2 shape: multi-head (no GQA), biases everywhere to exercise attention_bias / mlp_bias.
    "llama2_bias": dict(
        model_type="llama", num_key_value_heads=4, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5
    ),
    # Qwen2.5-0.5B shape: q/k/v bias, tied embeddings, MQA.
    "qwen2_tied": dict(model_type="qwen2", num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen2_untied": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=False),
    # Qwen3: per-head q/k RMSNorm and a head_dim that is not hidden / heads.
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=None, head_dim=16),
}

# Mixture-of-experts families, at widths _grouped_mm takes (rows of 16-byte multiples). Qwen3-MoE: top-2 of 4
# renormalised, QK-norm, a dense layer (mlp_only_layers); Qwen2-MoE: top-2 of 4 without renormalisation, a gated
# shared expert, q/k/v bias; Mixtral: top-2 of 4, always renormalised, experts of intermediate_size.
MOE_FAMILIES = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        num_hidden_layers=3,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
}

PAD_ID = 0


def hf_config(name: str, **overrides):
    from transformers import AutoConfig

    settings = dict({**FAMILIES, **MOE_FAMILIES}[name])
    model_type = settings.pop("model_type")
    base = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
    )
    return AutoConfig.for_model(model_type, **{**base, **settings, **overrides})


def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Randomise every parameter, norms and biases included, so parity cannot pass by zero biases or unit norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def write_hf_model(name: str, out_dir: str, *, kind: str = "lm", seed: int = 0, **overrides):
    """Random-init a ``transformers`` model of family ``name`` and save it; returns the HF model (eval mode)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    torch.manual_seed(seed)
    config = hf_config(name, **overrides)
    config._attn_implementation = "eager"
    factory = {
        "lm": AutoModelForCausalLM,
        "score": AutoModelForSequenceClassification,
        "value": AutoModelForTokenClassification,
    }[kind]
    if kind != "lm":
        config.num_labels = 1
    model = factory.from_config(config, attn_implementation="eager")
    perturb_(model, seed)
    model.save_pretrained(out_dir)
    return model.eval()


def padded_batch(*, batch: int, seq: int, side: str, vocab: int = 101, seed: int = 0):
    """Random ids with rows of different lengths padded on ``side``; returns (input_ids, attention_mask,
    position_ids)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [seq - 3 * row for row in range(batch)]
    input_ids = torch.full((batch, seq), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros(batch, seq, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens = torch.randint(3, vocab, (length,), generator=generator)
        span = slice(seq - length, seq) if side == "left" else slice(0, length)
        input_ids[row, span] = tokens
        attention_mask[row, span] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids
