"""Decoder-only LLMs (Llama / Qwen2 / Qwen3 / Mistral) with LM, value and score heads, and Hugging Face weight I/O."""

from spmd_rlhf.models.args import DecoderArgs, ModelConfigError, args_from_hf_config, read_decoder_args
from spmd_rlhf.models.decoder import HEADS, DecoderLM
from spmd_rlhf.models.logprob import entropy_from_logits, log_probs_and_entropy_from_logits, log_probs_from_logits
from spmd_rlhf.models.weights import CheckpointMismatchError, load_model, model_from_tensors, save_pretrained

__all__ = [
    "HEADS",
    "CheckpointMismatchError",
    "DecoderArgs",
    "DecoderLM",
    "ModelConfigError",
    "args_from_hf_config",
    "entropy_from_logits",
    "load_model",
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
    "model_from_tensors",
    "read_decoder_args",
    "save_pretrained",
]
