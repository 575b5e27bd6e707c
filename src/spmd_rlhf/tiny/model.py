"""Write a tiny random-init model and its tokenizer in Hugging Face format, for tests and CPU demos without a model hub.

    spmd-rlhf make-tiny --family qwen2 --out tiny/model
    spmd-rlhf make-tiny --family llama --head score --out tiny/reward

The directory holds what a real checkpoint does (config.json, model.safetensors, tokenizer files, chat template and,
for LM heads, generation_config.json), so every loader in the package can be tested against it and against
`transformers` itself. The tokenizer is trained on the arithmetic task's text (and optionally the tool task's), so
the model can learn that task with RL.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from spmd_rlhf.tiny.task import task_corpus
from spmd_rlhf.tiny.tokenizer import train_tokenizer

HEADS = ("lm", "score")

# Per family: the config class and what differs from the shared fields. Qwen2 ties embeddings like Qwen2.5-0.5B and
# takes no head_dim (it always uses hidden / heads); its q/k/v biases are built in. Sliding windows are off everywhere
# so attention is plain causal at every length.
_FAMILIES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, {"tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True, "use_sliding_window": False}),
    "qwen3": (Qwen3Config, {"tie_word_embeddings": False, "use_sliding_window": False}),
    "mistral": (MistralConfig, {"tie_word_embeddings": False, "sliding_window": None}),
    # Mixture of experts: Qwen3-MoE renormalises its top-k like Qwen3-30B-A3B; Qwen2-MoE adds its gated shared
    # expert; Mixtral's experts are intermediate_size wide.
    "qwen3_moe": (Qwen3MoeConfig, {"tie_word_embeddings": False, "use_sliding_window": False, "norm_topk_prob": True}),
    "qwen2_moe": (Qwen2MoeConfig, {"tie_word_embeddings": False, "use_sliding_window": False}),
    "mixtral": (MixtralConfig, {"tie_word_embeddings": False, "sliding_window": None}),
}
_FAMILIES_WITH_HEAD_DIM = ("llama", "qwen3", "mistral", "qwen3_moe", "mixtral")

# A little ordinary prose so the tokenizer learns some letter merges and is not arithmetic-only.
_GENERIC_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A small model learns to add two numbers: the answer is their sum.",
    "Please answer with a single number and nothing else.",
    "Reinforcement learning improves the policy from the rewards of its own samples.",
]

MAX_POSITION_EMBEDDINGS = 512


UNFILLED_VOCABULARY = 4
"""``make_tiny`` refuses a ``vocab_size`` this many times the tokenizer its corpus trains, without
``model_vocab_size``: a real vocabulary's size meant for the model."""


def make_tiny(
    *,
    family: str,
    out_dir: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    model_vocab_size: int | None = None,
    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS,
    head: str = "lm",
    tie_word_embeddings: bool | None = None,
    tokenizer_tasks: tuple[str, ...] = ("arithmetic",),
    chat_template: str = "chatml",
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    seed: int = 0,
) -> str:
    """Train a tokenizer, build a random-init `family` model seeded by `seed`, save both to `out_dir`; return it.

    `vocab_size` bounds the tokenizer's vocabulary; the model's is `len(tokenizer)`, or `model_vocab_size` rows when
    given (real checkpoints pad theirs past the tokenizer, e.g. Qwen2.5's 151936 rows for 151665 tokens, so a model
    of a real shape can be written with this small tokenizer). `head="lm"` gives a `*ForCausalLM`, `head="score"` a
    `*ForSequenceClassification` with one output (reward or value model). `intermediate_size` defaults to
    4 x `hidden_size`. `tie_word_embeddings` overrides the family's default (qwen2 ties, like Qwen2.5-0.5B; its 7B
    and larger do not). `tokenizer_tasks` are the tasks whose text the tokenizer is trained on (``task_corpus``):
    add "tool_products" for a tokenizer that writes a calculator call in about 30 tokens instead of 77.
    `chat_template` names the tokenizer's template (``tokenizer.CHAT_TEMPLATES``): ChatML, or ``role_colon`` for a
    model that reads conversations unlike the policy (a reward model of another family).
    The mixture-of-experts families (qwen3_moe, qwen2_moe, mixtral) route each token to `num_experts_per_tok` of
    `num_experts` experts, each `moe_intermediate_size` wide (default `hidden_size`; Mixtral's are
    `intermediate_size`); Qwen2-MoE's shared expert is `intermediate_size` wide.
    """
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; allowed families: {', '.join(_FAMILIES)}")
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; allowed heads: {', '.join(HEADS)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
            "num_heads must divide hidden_size and num_kv_heads must divide num_heads"
        )
    corpus = [text for task in tokenizer_tasks for text in task_corpus(task)]
    tokenizer = train_tokenizer(corpus + _GENERIC_TEXT, vocab_size=vocab_size, chat_template=chat_template)
    if model_vocab_size is not None and model_vocab_size < len(tokenizer):
        raise ValueError(
            f"model_vocab_size={model_vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens; "
            f"give at least {len(tokenizer)} or leave it out"
        )
    if model_vocab_size is None and vocab_size > UNFILLED_VOCABULARY * len(tokenizer):
        # A real vocabulary's size given as the tokenizer's bound: the model would silently get the corpus's few
        # hundred rows (benchmarks/sequence_parallel_cpu.py measured such a model in session 43).
        raise ValueError(
            f"vocab_size={vocab_size} bounds the tokenizer, which this small corpus fills to {len(tokenizer)} tokens, "
            f"so the model would have {len(tokenizer)} rows; for a model with {vocab_size} vocabulary rows pass "
            f"model_vocab_size={vocab_size} (make-tiny --model-vocab-size)"
        )
    config_class, family_fields = _FAMILIES[family]
    if tie_word_embeddings is not None:
        family_fields = {**family_fields, "tie_word_embeddings": tie_word_embeddings}
    fields = dict(
        vocab_size=len(tokenizer) if model_vocab_size is None else model_vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size if intermediate_size is None else intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **family_fields,
    )
    if family in _FAMILIES_WITH_HEAD_DIM:
        fields["head_dim"] = hidden_size // num_heads
    fields.update(_expert_fields(family, fields, num_experts, num_experts_per_tok, moe_intermediate_size))
    config = config_class(**fields)

    torch.manual_seed(seed)
    if head == "lm":
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if head == "lm":
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ).save_pretrained(out)
    return out_dir


def _expert_fields(
    family: str, fields: dict, num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int | None
) -> dict:
    """The config fields of a mixture-of-experts family's experts (none for a dense family)."""
    if family == "mixtral":
        return {"num_local_experts": num_experts, "num_experts_per_tok": num_experts_per_tok}
    if family not in ("qwen3_moe", "qwen2_moe"):
        return {}
    experts = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": fields["hidden_size"] if moe_intermediate_size is None else moe_intermediate_size,
    }
    if family == "qwen2_moe":
        experts["shared_expert_intermediate_size"] = fields["intermediate_size"]
    return experts


def raise_eos_logit(model_dir: str, *, scale: float = 10.0) -> None:
    """Rewrite ``model_dir``'s untied LM head so its EOS row points along the mean of the final hidden states (on
    random tokens), ``scale`` / |mean| long: a random-init model then ends a response after a few tokens instead of
    almost never. Multi-turn tests and benchmarks need turns that end, as a trained model's do."""
    from safetensors.torch import load_file, save_file

    from spmd_rlhf.models import load_model

    model = load_model(model_dir, head="lm", dtype=torch.float32, attention_backend="torch")
    if model.args.tie_word_embeddings:
        raise ValueError(f"{model_dir} ties its LM head to the embedding; make it with tie_word_embeddings=False")
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0].detach()))
    with torch.no_grad():
        model(torch.randint(0, model.args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)))
    hook.remove()
    mean = captured[0].reshape(-1, captured[0].shape[-1]).mean(dim=0)
    path = Path(model_dir) / "model.safetensors"
    weights = load_file(path)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    weights["lm_head.weight"][eos] = scale * mean / mean.dot(mean)
    save_file(weights, path, metadata={"format": "pt"})
