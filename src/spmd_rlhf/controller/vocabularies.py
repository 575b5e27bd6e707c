"""Every model of a run reads the policy's token ids: a check, before any role is built, that each one can.

The reference, critic, reward and cost models are given the actor's prompt and response ids as they are. A model
whose embedding is smaller than the policy tokenizer fails mid-run on an out-of-range id; one with another tokenizer
of its own reads every id as a different token and scores nonsense without an error.
"""

from __future__ import annotations

from pathlib import Path

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.models.args import read_decoder_args

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_role_vocabularies(config: FrameworkConfig, tokenizer) -> None:
    """Raise a ``ValueError`` naming the first role whose model (``<role>.model_path``) cannot read ``tokenizer``'s
    ids: an embedding smaller than the tokenizer, or a tokenizer of its own with another vocabulary."""
    from transformers import AutoTokenizer

    policy_vocabulary = None
    tokenizer_path = config.model.tokenizer_path or config.model.path
    for name, role in config.enabled_roles().items():
        if name == "actor" or not role.model_path or role.model_path == config.model.path:
            continue
        vocab_size = read_decoder_args(role.model_path).vocab_size
        if vocab_size < len(tokenizer):
            raise ValueError(
                f"{name}.model_path={role.model_path} has vocab_size={vocab_size}, fewer than the {len(tokenizer)} "
                f"tokens of the policy's tokenizer ({tokenizer_path}); {name} reads the actor's token ids, so it "
                f"must be a model of the same tokenizer: point {name}.model_path at one"
            )
        if any(Path(role.model_path, file).is_file() for file in _TOKENIZER_FILES):
            policy_vocabulary = policy_vocabulary or tokenizer.get_vocab()
            if AutoTokenizer.from_pretrained(role.model_path).get_vocab() != policy_vocabulary:
                raise ValueError(
                    f"{name}.model_path={role.model_path} has a tokenizer with another vocabulary than the policy's "
                    f"({tokenizer_path}); {name} reads the actor's token ids, so it must be a model of the same "
                    f"tokenizer: point {name}.model_path at one"
                )
