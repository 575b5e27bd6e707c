"""``model``: the policy model and how every model runs."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rlhf.config.choices import ATTENTION_BACKENDS, CHECKPOINT_POLICIES, COMPILE_SETTINGS
from spmd_rlhf.config.errors import one_of


@dataclass
class ModelConfig:
    path: str = "tiny/model"
    """Policy model directory in Hugging Face format; the actor and reference load it, the critic starts from it."""
    tokenizer_path: str | None = None
    """Tokenizer directory; null: model.path."""
    dtype: str = "float32"
    """Dtype of forward passes in training and generation: float32, bfloat16 or float16."""
    attention: str = "auto"
    """Attention backend: auto (flash when installed, else sdpa), flash, sdpa or torch (plain matmul, runs anywhere)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass of trained roles: less memory, more compute
    (checkpoint_policy says how much)."""
    checkpoint_policy: str = "full"
    """What activation_checkpointing recomputes: full (a block keeps only its input; the whole block runs again in the
    backward: about a third more compute) or selective (a block keeps its matmuls' and attention's outputs and
    recomputes only the norms, rotations, activation function and residual adds: about half the activations of no
    checkpointing at Qwen2.5-1.5B's widths, for a few elementwise passes)."""
    activation_offload: bool = False
    """GPU: each trained role's activations kept for the backward (tensors autograd saves, parameters aside, of 1 MiB
    or more) go to pinned host memory during the forward and come back for the backward, on the compute stream
    (training.activation_offload): device memory for two PCIe copies. Off the GPU they stay where they are."""
    compile: str = "auto"
    """torch.compile each decoder block of every role's training-layout model (one graph per block, no graph break,
    packed lengths dynamic; ring attention's exchanges run eagerly between two compiled pieces): auto (on CUDA, at
    any tp, cp and ep), on (CPU too: needs a C++ compiler) or off."""

    def __post_init__(self) -> None:
        one_of(self, "dtype", ("float32", "bfloat16", "float16"))
        one_of(self, "attention", ATTENTION_BACKENDS)
        one_of(self, "compile", COMPILE_SETTINGS)
        one_of(self, "checkpoint_policy", CHECKPOINT_POLICIES)
