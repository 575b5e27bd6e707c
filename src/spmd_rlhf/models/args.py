"""Decoder hyper-parameters read from a Hugging Face ``config.json``, with every field checked.

One ``DecoderArgs`` describes every supported family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral without sliding window,
and the mixture-of-experts Qwen2-MoE, Qwen3-MoE and Mixtral, whose expert settings are ``DecoderArgs.moe``).
A key in ``config.json`` that this model cannot honour is a ``ModelConfigError`` naming the key, never ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """A Hugging Face config asks for something the spmd_rlhf decoder cannot honour."""


SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Keys that do not change the math of a forward pass (bookkeeping, generation defaults, tokenizer ids, init ranges),
# or that the decoder reads below. A key outside this set and the family's own set is rejected.
_COMMON_KEYS = {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "model_type",
    "dtype",
    "torch_dtype",
    "use_cache",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "id2label",
    "label2id",
    "num_labels",
    "problem_type",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tie_word_embeddings",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_dropout",
    "layer_types",
    "classifier_dropout",
    "token_classification_bias",
    "generation_config",
    "tokenizer_class",
    "auto_map",
    "pretraining_tp",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "attention_bias",
    "mlp_bias",
    "partial_rotary_factor",
}

# The mixture-of-experts keys, read by ``_moe_args`` (router_aux_loss_coef is kept for the load-balancing loss;
# output_router_logits only asks transformers to return the logits).
_MOE_KEYS = {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "output_router_logits",
    "qkv_bias",
}


@dataclass(frozen=True)
class MoEArgs:
    """The mixture-of-experts settings of a model whose feed-forward blocks route tokens to experts."""

    num_experts: int
    num_experts_per_tok: int
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int
    """Each routed expert's SwiGLU width (Mixtral: ``intermediate_size``)."""
    norm_topk_prob: bool
    """Renormalise the chosen experts' probabilities to sum to 1 (Mixtral always does)."""
    shared_expert_intermediate_size: int
    """Qwen2-MoE's always-on shared expert's width, gated per token by a sigmoid; 0: none."""
    layers: tuple[int, ...]
    """Indices of the layers with an MoE block; the others keep a dense MLP of ``intermediate_size``."""
    router_aux_loss_coef: float
    """The config's load-balancing loss coefficient (not applied by the model)."""


@dataclass(frozen=True)
class DecoderArgs:
    """Everything the decoder needs to build itself, family differences reduced to flags."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    moe: MoEArgs | None = None
    """Mixture-of-experts settings; None for a dense model."""
    hf_config: Any = field(default=None, compare=False, repr=False)
    """The ``transformers`` config object this was read from; written back unchanged by ``save_pretrained``."""


LLAMA_LAYOUT = dict(
    family="llama",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
)
"""What ``decoder_args`` fills in: Llama's layout (no biases, untied, no QK norm, RoPE at theta 10,000 unscaled)."""


def decoder_args(**fields: Any) -> DecoderArgs:
    """``DecoderArgs`` of a model built in code rather than read from a checkpoint (calibration, tests, benchmarks):
    the sizes given in ``fields``, and ``LLAMA_LAYOUT`` for whatever ``fields`` leaves out."""
    return DecoderArgs(**(LLAMA_LAYOUT | fields))


def _raw_config_dict(path: str) -> dict[str, Any]:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        problem = "no config.json" if os.path.isdir(path) else "no such directory"
        raise ModelConfigError(f"{path}: {problem}; expected a Hugging Face model directory")
    with open(config_file, encoding="utf-8") as handle:
        return json.load(handle)


def _rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either the transformers 5 ``rope_parameters`` or the 4.x fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    theta = float(params.pop("rope_theta"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope_scaling.rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.pop("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported; only 1.0 (full rotary)")
    if rope_type == "default":
        return theta, None
    required = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    }
    missing = [key for key in required[rope_type] if key not in params]
    if missing:
        raise ModelConfigError(f"rope_scaling type {rope_type!r} needs {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **{key: params[key] for key in required[rope_type]}}


def _check_attention_window(family: str, hf_config: Any) -> None:
    window = getattr(hf_config, "sliding_window", None)
    max_positions = hf_config.max_position_embeddings
    if family in ("mistral", "mixtral"):
        needs_window = window is not None and window < max_positions
    else:
        needs_window = (
            bool(getattr(hf_config, "use_sliding_window", False)) and window is not None and window < max_positions
        )
    if needs_window:
        raise ModelConfigError(
            f"sliding_window={window} (< max_position_embeddings={max_positions}) is not supported: sliding-window "
            "attention is not implemented; use a checkpoint without it (e.g. Mistral v0.2+) or set sliding_window: null"
        )
    # With no effective window, "sliding_attention" layers attend to every position, exactly like full attention.
    layer_types = getattr(hf_config, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise ModelConfigError(f"layer_types contains {other}; only full_attention is supported")


def args_from_hf_config(hf_config: Any, raw: dict[str, Any] | None = None) -> DecoderArgs:
    """Check a ``transformers`` config and reduce it to ``DecoderArgs``.

    ``raw`` is the ``config.json`` dict when reading from disk, used to reject keys the decoder does not know.
    """
    family = hf_config.model_type
    if family not in SUPPORTED_FAMILIES:
        raise ModelConfigError(f"model_type={family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if raw is not None:
        unknown = sorted(set(raw) - _COMMON_KEYS - (_MOE_KEYS if family in MOE_FAMILIES else set()))
        if unknown:
            raise ModelConfigError(
                f"config.json key(s) {', '.join(unknown)} are not supported for model_type={family!r}"
            )
    if hf_config.hidden_act != "silu":
        raise ModelConfigError(f"hidden_act={hf_config.hidden_act!r} is not supported; only 'silu' (SwiGLU MLP)")
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ModelConfigError(f"attention_dropout={hf_config.attention_dropout} is not supported; only 0.0")
    _check_attention_window(family, hf_config)
    theta, scaling = _rope_settings(hf_config)
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
        )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if head_dim % 2:
        raise ModelConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
    # Transformers reads these flags only for some families; read them exactly where it does.
    attention_bias = family in ("llama", "qwen3", "qwen3_moe") and bool(getattr(hf_config, "attention_bias", False))
    mlp_bias = family == "llama" and bool(getattr(hf_config, "mlp_bias", False))
    qkv_bias = family == "qwen2" or (family == "qwen2_moe" and bool(getattr(hf_config, "qkv_bias", True)))
    return DecoderArgs(
        family=family,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        moe=_moe_args(hf_config) if family in MOE_FAMILIES else None,
        hf_config=hf_config,
    )


def _moe_args(hf_config: Any) -> MoEArgs:
    """The expert settings of a Qwen2-MoE / Qwen3-MoE / Mixtral config, read the way transformers reads them."""
    family = hf_config.model_type
    if family == "mixtral":
        num_experts, width, renormalize = hf_config.num_local_experts, hf_config.intermediate_size, True
        layers = tuple(range(hf_config.num_hidden_layers))
        jitter = getattr(hf_config, "router_jitter_noise", 0.0)
        if jitter:
            raise ModelConfigError(f"router_jitter_noise={jitter} is not supported; only 0.0")
    else:
        num_experts, width = hf_config.num_experts, hf_config.moe_intermediate_size
        renormalize = bool(hf_config.norm_topk_prob)
        step, dense_layers = hf_config.decoder_sparse_step, set(hf_config.mlp_only_layers or [])
        layers = tuple(
            index
            for index in range(hf_config.num_hidden_layers)
            if index not in dense_layers and num_experts > 0 and (index + 1) % step == 0
        )
    top_k = hf_config.num_experts_per_tok
    if not 0 < top_k <= num_experts:
        raise ModelConfigError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    return MoEArgs(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=renormalize,
        shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size if family == "qwen2_moe" else 0,
        layers=layers,
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
    )


def read_decoder_args(path: str) -> DecoderArgs:
    """Read and check ``path/config.json`` (through ``transformers.AutoConfig``)."""
    from transformers import AutoConfig

    raw = _raw_config_dict(path)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (KeyError, ValueError) as error:
        raise ModelConfigError(f"{path}/config.json is not a valid Hugging Face config: {error}") from error
    return args_from_hf_config(hf_config, raw)
