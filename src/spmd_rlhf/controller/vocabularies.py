"""Every model of a run reads the policy's token ids, or text through its own tokenizer: a check, before any role is
built, that each one can.

The reference and critic are given the actor's prompt and response ids as they are; so is a reward or cost model
that has no tokenizer of its own or one with the policy's vocabulary and chat template. A model whose embedding is
smaller than the policy tokenizer fails mid-run on an out-of-range id; one with another tokenizer of its own reads
every id as a different token and scores nonsense without an error. A reward or cost model whose own tokenizer
differs from the policy's scores the conversation rebuilt as text in its tokens instead (``data.retokenize``).
"""

from __future__ import annotations

from spmd_rlhf.config import FrameworkConfig, ScoringRoleConfig
from spmd_rlhf.data.retokenize import (
    ChatRebuild,
    foreign_tokenizer,
    has_tokenizer,
    judge_tokenizer,
    scorer_tokenizer_path,
)
from spmd_rlhf.models.args import read_decoder_args


def check_role_vocabularies(config: FrameworkConfig, tokenizer) -> None:
    """Raise a ``ValueError`` naming the first role whose model (``<role>.model_path``) cannot read ``tokenizer``'s
    ids: an embedding smaller than the tokenizer, or a tokenizer of its own with another vocabulary; for a reward or
    cost model with a tokenizer of its own, one that cannot rebuild the conversations (no chat template, multi-turn
    rollouts); for one without, an embedding of another size than the policy's (its tokenizer cannot be told)."""
    from transformers import AutoTokenizer

    policy_vocabulary = None
    tokenizer_path = config.model.tokenizer_path or config.model.path
    for name, role in config.enabled_roles().items():
        if name == "actor":
            continue
        if isinstance(role, ScoringRoleConfig) and role.kind == "generative":
            _check_judge(config, name, role, tokenizer)
            continue
        scoring_model = isinstance(role, ScoringRoleConfig) and role.kind == "model"
        if scoring_model:
            own_tokenizer = foreign_tokenizer(role, tokenizer)
            if own_tokenizer is not None:
                _check_rebuildable(config, name, own_tokenizer, tokenizer)
                continue
        if not role.model_path or role.model_path == config.model.path:
            continue
        vocab_size = read_decoder_args(role.model_path).vocab_size
        if vocab_size < len(tokenizer):
            raise ValueError(
                f"{name}.model_path={role.model_path} has vocab_size={vocab_size}, fewer than the {len(tokenizer)} "
                f"tokens of the policy's tokenizer ({tokenizer_path}); {name} reads the actor's token ids, so it "
                f"must be a model of the same tokenizer: point {name}.model_path at one"
                + (f", or {name}.tokenizer_path at the tokenizer it was trained with" if scoring_model else "")
            )
        if scoring_model and scorer_tokenizer_path(role) is None:
            policy_size = read_decoder_args(config.model.path).vocab_size
            if vocab_size != policy_size:
                raise ValueError(
                    f"{name}.model_path={role.model_path} holds no tokenizer, and its vocab_size={vocab_size} differs "
                    f"from the policy model's {policy_size}, so whether it reads the policy's token ids cannot be "
                    f"told; set {name}.tokenizer_path to the tokenizer it was trained with ({tokenizer_path} if it "
                    f"is the policy's)"
                )
        elif not scoring_model and has_tokenizer(role.model_path):
            policy_vocabulary = policy_vocabulary or tokenizer.get_vocab()
            if AutoTokenizer.from_pretrained(role.model_path).get_vocab() != policy_vocabulary:
                raise ValueError(
                    f"{name}.model_path={role.model_path} has a tokenizer with another vocabulary than the policy's "
                    f"({tokenizer_path}); {name} reads the actor's token ids, so it must be a model of the same "
                    f"tokenizer: point {name}.model_path at one"
                )


def _check_rebuildable(config: FrameworkConfig, name: str, own_tokenizer, tokenizer) -> None:
    """A scoring model with a tokenizer of its own rebuilds each conversation: its tokenizer needs a chat template,
    and a multi-turn trajectory (tool calls and observations in the policy's layout) has no rebuild yet."""
    ChatRebuild(tokenizer, own_tokenizer, role=name)
    if config.rollout.environment is not None:
        raise ValueError(
            f"{name}: the scoring model's tokenizer ({own_tokenizer.name_or_path}) differs from the policy's, and "
            f"rollout.environment={config.rollout.environment} makes multi-turn trajectories, which cannot be "
            f"rebuilt in its chat template yet; score them with a model of the policy's tokenizer, a rule or a "
            f"remote service"
        )


def _check_judge(config: FrameworkConfig, name: str, role: ScoringRoleConfig, tokenizer) -> None:
    """A generative judge reads text in its own tokenizer (or the policy's, when its directory holds none): one with a
    chat template, whose ids all fit the judge's embedding; multi-turn trajectories have no text rebuild yet."""
    own = judge_tokenizer(role, tokenizer, role=name)
    vocab_size = read_decoder_args(role.model_path).vocab_size
    if len(own) > vocab_size:
        raise ValueError(
            f"{name}.model_path={role.model_path} has vocab_size={vocab_size}, fewer than the {len(own)} tokens of "
            f"the tokenizer the judge would read with ({own.name_or_path}); set {name}.tokenizer_path to the "
            f"judge's own tokenizer"
        )
    if config.rollout.environment is not None:
        raise ValueError(
            f"{name}: rollout.environment={config.rollout.environment} makes multi-turn trajectories, which a "
            f"generative judge cannot read as text yet; score them with a rule, a reward model or a remote service"
        )
