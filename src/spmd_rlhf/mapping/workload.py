"""What the mapper places: the models (shapes, by name or config), the step's batch, and each algorithm's model
roles with the work each does in the paper's stages (generation, preparation, training), from the algorithm's
declared dataflow (``spmd_rlhf.config.dataflow``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spmd_rlhf.config.dataflow import (
    KL_TO_ACTOR_BASE,
    KL_TO_REFERENCE,
    ON_ACTOR,
    RECOMPUTE_LOG_PROBS,
    ROLE_KINDS,
    ROLLOUT_ROLE,
    STAGES,  # noqa: F401  (the mapper's stages are the dataflow's)
    dataflow_of,
)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that fix its FLOPs, bytes and how it may be split. A mixture-of-experts model
    (``experts`` > 0) has ``moe_layers`` layers whose feed-forward block is a router over ``experts`` SwiGLU experts
    of width ``expert_intermediate``, ``experts_per_token`` of them run per token, plus an optional gated shared
    expert; the other layers keep a dense MLP of width ``intermediate``. Memory counts every expert, FLOPs only the
    ones a token runs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0
    """0: hidden / heads."""
    tied: bool = False
    """Embedding and LM head share one matrix (then pipeline parallelism is not available)."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMS norms on each head's queries and keys (Qwen3)."""
    experts: int = 0
    """Routed experts of each MoE layer; 0: a dense model."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    """Qwen2-MoE's shared expert's width (0: none), gated per token by a one-output linear layer."""
    moe_layers: int = 0

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def _attention_and_norms(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (2 * q + 2 * kv) + self.qkv_bias * (q + 2 * kv) + self.o_bias * self.hidden
        return attention + 2 * self.hidden + self.qk_norm * 2 * self.head_dim

    @property
    def _dense_mlp(self) -> int:
        return 3 * self.hidden * self.intermediate + self.mlp_bias * (2 * self.intermediate + self.hidden)

    def _moe_mlp(self, experts: int) -> int:
        """An MoE block's router, ``experts`` routed experts and the gated shared expert."""
        shared = (
            3 * self.hidden * self.shared_expert_intermediate + self.hidden if self.shared_expert_intermediate else 0
        )
        return self.hidden * self.experts + experts * 3 * self.hidden * self.expert_intermediate + shared

    @property
    def routed_expert_parameters(self) -> int:
        """Parameters of every MoE layer's routed experts (what expert parallelism splits)."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def block_parameters(self) -> int:
        """Parameters of the largest decoder block: attention projections, the gated MLP or MoE block (every expert),
        biases and norms."""
        dense = self._dense_mlp if self.moe_layers < self.layers else 0
        moe = self._moe_mlp(self.experts) if self.moe_layers else 0
        return self._attention_and_norms + max(dense, moe)

    @property
    def body_parameters(self) -> int:
        """Parameters of all decoder blocks (every expert)."""
        moe = self.moe_layers * self._moe_mlp(self.experts)
        return self.layers * self._attention_and_norms + (self.layers - self.moe_layers) * self._dense_mlp + moe

    def head_parameters(self, head: str) -> int:
        """Parameters of the output head: lm, the vocabulary projection (a matmul even when tied to the embedding);
        value, one output with a bias; score, one output, no bias."""
        return {"lm": self.vocab * self.hidden, "value": self.hidden + 1, "score": self.hidden}[head]

    @property
    def body_matmul_parameters(self) -> int:
        """Parameters the body multiplies activations with at every token: the blocks (of an MoE block, the router,
        the ``experts_per_token`` experts a token runs and the shared expert) and the final norm (the embedding is a
        lookup)."""
        moe = self.moe_layers * self._moe_mlp(self.experts_per_token)
        dense = (self.layers - self.moe_layers) * self._dense_mlp
        return self.layers * self._attention_and_norms + dense + moe + self.hidden

    def matmul_parameters(self, head: str) -> int:
        """Parameters that multiply activations (all but the embedding lookup): N of the 2·N FLOPs per token of a
        pass that runs the head at every token, as generation does."""
        return self.body_matmul_parameters + self.head_parameters(head)

    def parameters(self, head: str) -> int:
        """All parameters (a tied LM head counted once)."""
        head_parameters = 0 if (head == "lm" and self.tied) else self.head_parameters(head)
        return self.vocab * self.hidden + self.body_parameters + self.hidden + head_parameters

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of keys and values one token keeps in the KV cache, over all layers and KV heads."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


NAMED_SHAPES = {
    "0.5b": ModelShape(
        hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tied=True, qkv_bias=True
    ),
    "1.5b": ModelShape(
        hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tied=True, qkv_bias=True
    ),
    "3b": ModelShape(
        hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936, tied=True, qkv_bias=True
    ),
    "7b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000),
    "8b": ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "13b": ModelShape(hidden=5120, layers=40, heads=40, kv_heads=40, intermediate=13824, vocab=32000),
    "34b": ModelShape(hidden=8192, layers=48, heads=64, kv_heads=8, intermediate=22016, vocab=32000),
    "70b": ModelShape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=32000),
    "30b-a3b": ModelShape(
        hidden=2048,
        layers=48,
        heads=32,
        kv_heads=4,
        head_dim=128,
        intermediate=6144,
        vocab=151936,
        qk_norm=True,
        experts=128,
        experts_per_token=8,
        expert_intermediate=768,
        moe_layers=48,
    ),
}
"""Shapes by size name: Qwen2.5 (0.5b–3b), Llama 2 (7b, 13b, 70b), Llama 3 (8b), Code Llama (34b), Qwen3-30B-A3B
(30b-a3b: 128 experts, 8 per token)."""


def lora_parameters(shape: ModelShape, head: str, modules: Sequence[str], rank_of: Callable[[str], int]) -> int:
    """Parameters a LoRA role trains: ``r (in + out)`` for each of ``modules`` (PEFT's layer names) in every decoder
    layer, ``r = rank_of(its full module name)``, on attention, dense MLPs and an MoE layer's shared expert (the
    routed experts and routers stay frozen, as ``models.lora`` leaves them; MoE layers counted last), and a value or
    score head, which trains whole beside the adapters."""
    h = shape.hidden
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    total = 0 if head == "lm" else shape.head_parameters(head)
    for index in range(shape.layers):
        widths = {f"model.layers.{index}.self_attn.{name}": size for name, size in attention.items()}
        moe = index >= shape.layers - shape.moe_layers
        width = shape.shared_expert_intermediate if moe else shape.intermediate
        prefix = f"model.layers.{index}.mlp" + (".shared_expert" if moe else "")
        if width:
            widths.update({f"{prefix}.{name}": h + width for name in ("gate_proj", "up_proj", "down_proj")})
        total += sum(rank_of(name) * size for name, size in widths.items() if name.rsplit(".", 1)[1] in modules)
    return total


def model_shape(name_or_path: str) -> ModelShape:
    """A shape by size name (``7b``) or from a Hugging Face model directory's ``config.json``."""
    if name_or_path.lower() in NAMED_SHAPES:
        return NAMED_SHAPES[name_or_path.lower()]
    from spmd_rlhf.models.args import read_decoder_args

    if not os.path.isfile(os.path.join(name_or_path, "config.json")):
        raise ValueError(
            f"model {name_or_path!r}: neither a size name ({', '.join(NAMED_SHAPES)}) nor a model directory with a "
            f"config.json"
        )
    args = read_decoder_args(name_or_path)
    return ModelShape(
        hidden=args.hidden_size,
        layers=args.num_layers,
        heads=args.num_heads,
        kv_heads=args.num_kv_heads,
        intermediate=args.intermediate_size,
        vocab=args.vocab_size,
        head_dim=args.head_dim,
        tied=args.tie_word_embeddings,
        qkv_bias=args.qkv_bias,
        o_bias=args.o_bias,
        mlp_bias=args.mlp_bias,
        qk_norm=args.qk_norm,
        **(_moe_shape(args.moe) if args.moe else {}),
    )


def _moe_shape(moe) -> dict[str, int]:
    return {
        "experts": moe.num_experts,
        "experts_per_token": moe.num_experts_per_tok,
        "expert_intermediate": moe.moe_intermediate_size,
        "shared_expert_intermediate": moe.shared_expert_intermediate_size,
        "moe_layers": len(moe.layers),
    }


@dataclass(frozen=True)
class Batch:
    """One step's rows and lengths."""

    prompts: int
    """Prompts per step."""
    samples: int = 1
    """Responses per prompt."""
    prompt_length: int = 512
    response_length: int = 512
    micro_batch_size: int = 4
    """Rows per forward/backward pass on each data-parallel rank of a trained role."""
    mini_batch_size: int = 0
    """Rows per optimizer step over all data-parallel ranks; 0: the whole batch (one step per epoch). Trained roles'
    dp must then divide mini_batch_size / micro_batch_size."""
    ppo_epochs: int = 1
    dtype_bytes: int = 2
    """Bytes per element of weights and activations in forward passes (2: bf16)."""
    activation_checkpointing: bool = False
    checkpoint_policy: str = "full"
    """``model.checkpoint_policy``: what activation checkpointing keeps and recomputes."""
    memory_fraction: float = 0.9
    """Fraction of device memory the mapper may plan to fill."""
    keep_engine: bool = False
    """The actor keeps its generation copy and KV cache from one generation to the next (``rollout.keep_engine``):
    they then take memory in every other stage too."""
    max_staleness: int = 0
    """With a rollout role (``RoleSpec.replica``): ``algorithm.max_staleness``. 0 runs each batch's generation and
    the step's training one after the other; from 1 on the next batch generates while this one trains."""

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @property
    def sequence_length(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def tokens(self) -> int:
        """Prompt + response tokens of the step's rows (every response at full length: an upper bound)."""
        return self.rows * self.sequence_length


@dataclass(frozen=True)
class RoleSpec:
    """A model role of the dataflow and what it does in each stage."""

    name: str
    shape: ModelShape
    head: str
    """lm (actor, reference), value (critics) or score (reward and cost models)."""
    trained: bool
    work: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Stage -> the passes the role runs in it (``spmd_rlhf.config.dataflow.PASSES``)."""
    micro_batch_size: int = 0
    """This role's micro-batch; 0: the batch's."""
    mini_batch_size: int = 0
    """This role's rows per optimizer step; 0: the batch's."""
    judge_tokens: int = 0
    """A generative judge's most tokens written per response (``reward.judge_max_new_tokens``); 0: not a judge. Its
    forward pass is then generation over prompt + response by TP-only replicas (``search.role_stage_seconds``)."""
    unsharded_accumulation_mb: float | None = 4096.0
    """A trained role's ``<role>.unsharded_accumulation_mb``: the most a mini-batch may hold gathered beyond FSDP for
    one FSDP gather and one reduce-scatter per mini-batch (``cost.accumulates_unsharded``); None: no bound."""
    forward_gather_mb: float | None = 4096.0
    """``<role>.forward_gather_mb``: the most a forward-only call may hold gathered for one FSDP gather per call
    (``cost.gathers_forward_once``); None: no bound."""
    replica: bool = False
    """The rollout role of asynchronous RL: every DP rank holds a TP-sharded replica of the actor's weights (no FSDP
    shard, no reshard: the actor sends them), generates on it, and never shares devices with a trained role."""
    sequence_parallel: bool = False
    """``<role>.sequence_parallel``: at tp > 1 the residual stream's and the norms' activations split over
    tp, not whole on every TP rank (``cost.working_bytes``)."""
    lora_parameters: int = 0
    """A trained role's LoRA adapter parameters (``lora_parameters``; a value or score head's included): only these
    train (float32 weights, gradients and Adam's moments), the rest is a frozen base in the compute dtype; 0: the
    whole model trains."""


def dataflow(
    algorithm: str,
    *,
    actor: ModelShape,
    critic: ModelShape | None = None,
    reference: ModelShape | None = None,
    reward: ModelShape | None = None,
    cost: ModelShape | None = None,
    cost_critic: ModelShape | None = None,
    recompute_log_probs: bool = False,
) -> list[RoleSpec]:
    """The model roles of one step of ``algorithm`` (its recipe's declared dataflow), with their work per stage.

    A scorer given None is not a model (a rule reward or cost); no reference means no KL term
    (``kl_penalty: none``). The cost critic has the critic's shape unless given its own.
    """
    shapes = {
        "actor": actor,
        "critic": critic,
        "reference": reference,
        "reward": reward,
        "cost": cost,
        "cost_critic": cost_critic or critic,
    }
    # The mapper models a separate reference model (a LoRA actor serving its own reference is not modelled) and the
    # synchronous HybridEngine: the actor generates (no rollout role of its own).
    conditions = {
        KL_TO_REFERENCE.name: reference is not None,
        KL_TO_ACTOR_BASE.name: False,
        RECOMPUTE_LOG_PROBS.name: recompute_log_probs,
        ON_ACTOR.name: True,
        ROLLOUT_ROLE.name: False,
    }
    roles = []
    for name, work in dataflow_of(algorithm).roles(conditions).items():
        kind = ROLE_KINDS[name]
        if shapes[name] is None:
            if kind.may_be_rule:
                continue
            raise ValueError(f"algorithm {algorithm} trains a {name}: give its model (--{name.replace('_', '-')})")
        roles.append(RoleSpec(name, shapes[name], kind.head, kind.trained, work))
    return roles
