"""The configuration schema: nested dataclasses, one docstring per field, validated in ``__post_init__``.

Each section checks its own fields and names keys relative to itself (``tp=0: must be >= 1``); ``FrameworkConfig``
checks combinations across sections with full dotted keys. ``spmd_rlhf.config`` fills these from YAML and overrides
and adds the section prefix to a section's errors.
"""

import functools
from dataclasses import dataclass, field

from spmd_rlhf import dataflow
from spmd_rlhf.dataflow import GROUP_ALGORITHMS, ROLE_KINDS, ROLES
from spmd_rlhf.envs import ENVIRONMENTS

ALGORITHMS = tuple(dataflow.ALGORITHMS)
# The same names as spmd_rlhf.models.attention.BACKENDS (a test keeps them equal) without importing torch here.
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "flash")
# spmd_rlhf.models.attention.DEFAULT_KV_BLOCK_SIZE (a test keeps them equal): the smaller of
# rollout.kv_block_size=null's two block sizes, so the check of a fixed rollout.kv_cache_blocks budget holds whichever
# one a rank picks.
DEFAULT_KV_BLOCK_SIZE = 16
PLACEMENTS = ("colocate", "split", "standalone", "manual", "auto")
DEVICE_SETTINGS = ("auto", "cuda", "cpu")
# "off" and the names of spmd_rlhf.engine.IN_FLIGHT (a test keeps them equal) without importing torch here.
PARTIAL_ROLLOUTS = ("off", "keep_kv", "recompute_kv", "drop")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers LoRA can adapt, by PEFT's names: the layers of spmd_rlhf.models.parallelize's TP plan (a
test keeps them equal); all-linear means every one of them (never the LM head, as in PEFT)."""
"""The values of trainer.device (runtime.device.select_device turns one into a device and a backend)."""


class ConfigError(ValueError):
    """A config that cannot run, as one line: the dotted key, its value and what is allowed.

    A section's own ``__post_init__`` names keys relative to the section (``tp=0: ...``); ``load_config`` adds the
    section's prefix (``actor.tp=0: ...``).
    """


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
    """Recompute each decoder block's activations in the backward pass of trained roles: less memory, more compute."""
    compile: bool = False
    """torch.compile each decoder block (GPU only; ignored on CPU)."""

    def __post_init__(self) -> None:
        _one_of(self, "dtype", ("float32", "bfloat16", "float16"))
        _one_of(self, "attention", ATTENTION_BACKENDS)


@dataclass
class RoleConfig:
    enabled: bool = True
    """Run this role; must match the algorithm (GRPO has no critic, only safe_rlhf has a cost model)."""
    model_path: str | None = None
    """Model directory in Hugging Face format; null: model.path (a critic then starts with a fresh value head)."""
    pool: str | None = None
    """Resource pool name, with placement=manual only: roles naming the same pool are colocated on its ranks."""
    n_ranks: int = 0
    """Ranks (devices) the role spans; 0: all ranks of its pool, known at start from the world size."""
    pp: int = 1
    """Pipeline-parallel degree (stages of consecutive layers; the model must not tie its embedding and LM head)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule when pp > 1: 1f1b (less activation memory) or gpipe."""
    dp: int = 0
    """Data-parallel (FSDP) degree; 0: derived as n_ranks / (pp * tp)."""
    tp: int = 1
    """Tensor-parallel degree."""
    micro_batch_size: int = 4
    """Rows (responses) per forward and backward pass of training on each data-parallel rank."""
    forward_micro_batch_size: int = 0
    """Rows per forward-only pass (log-probs, values, scores), which keeps no activations; 0: micro_batch_size."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one micro-batch on each data-parallel rank, for training and forward-only passes alike (verl's
    ppo_max_token_len_per_gpu): rows are grouped into as few micro-batches of nearly equal token counts as fit it, so
    short responses share a pass and long ones get their own; every DP rank runs the same number. Must hold the
    longest row (data.max_prompt_length + rollout.max_new_tokens). null: micro_batch_size /
    forward_micro_batch_size rows per micro-batch. Either way a micro-batch is fed as one packed sequence of its
    rows' real tokens (no padding rows; with pp > 1, a few padding tokens give every micro-batch the same shapes)."""
    fsdp_unit_mb: float = 32.0
    """FSDP gathers (and reduce-scatters gradients of) one unit at a time, each at a fixed latency: consecutive decoder
    layers share a unit until it holds at least this many MiB of this rank's TP shard, so real shapes (a 0.5B layer is
    about 60 MB in float32) keep one layer per unit, and a model smaller than this is one unit with no per-layer
    collectives. Gathered memory grows to about this size per unit. 0: one unit per layer."""
    offload: bool = False
    """GPU: keep parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy), each block
    copied to the device for its forward and backward, so colocated roles leave the device to each other."""

    def __post_init__(self) -> None:
        _at_least(self, 0, "n_ranks", "dp", "forward_micro_batch_size", "fsdp_unit_mb")
        _at_least(self, 1, "pp", "tp", "micro_batch_size")
        _require(self, "pool", self.pool != "", "must be a name or null")
        _require(self, "pp_schedule", self.pp_schedule in ("1f1b", "gpipe"), "must be 1f1b or gpipe")
        budget = self.max_tokens_per_micro_batch
        _require(self, "max_tokens_per_micro_batch", budget is None or budget >= 1, "must be >= 1 or null")

    def dp_size(self) -> int | None:
        """The data-parallel degree: ``dp``, else derived from ``n_ranks``; None while the pool size is unknown."""
        if self.dp:
            return self.dp
        return self.n_ranks // (self.pp * self.tp) if self.n_ranks else None


@dataclass
class LoRAConfig:
    rank: int | None = None
    """Rank r of the LoRA adapters (Hu et al. 2021) on the decoder's linear layers: the base weights are frozen and only
    the adapters (and a critic's value head) train; null or 0: off, the whole model trains."""
    alpha: float = 16.0
    """Scaling numerator: an adapter adds (alpha / rank) * B A x to its layer's output (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Which linear layers of every decoder layer get adapters, by PEFT's names: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj, or [all-linear] for all of them."""
    adapter_path: str | None = None
    """Start from an existing PEFT adapter directory (adapter_config.json + adapter_model.safetensors) instead of fresh
    adapters (B = 0); its rank, alpha and target modules must match these keys."""

    def __post_init__(self) -> None:
        _require(self, "rank", self.rank is None or self.rank >= 0, "must be >= 0 or null (0 and null: LoRA off)")
        _require(self, "alpha", self.alpha > 0, "must be > 0")
        _require(self, "dropout", 0 <= self.dropout < 1, "must be in [0, 1)")
        targets = self.target_modules
        allowed = targets == ["all-linear"] or (bool(targets) and set(targets) <= set(LORA_TARGETS))
        _require(
            self, "target_modules", allowed, "must be [all-linear] or a non-empty list of " + ", ".join(LORA_TARGETS)
        )
        _require(self, "adapter_path", self.adapter_path != "", "must be a PEFT adapter directory or null")
        _require(self, "adapter_path", self.adapter_path is None or self.enabled, "needs rank >= 1 (LoRA on)")

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted layers' names, all-linear expanded."""
        return LORA_TARGETS if self.target_modules == ["all-linear"] else tuple(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank or 1)


@dataclass
class TrainableRoleConfig(RoleConfig):
    lr: float = 1e-5
    """Peak learning rate (AdamW)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW [beta1, beta2]."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Training steps of linear warm-up from 0 to lr."""
    lr_schedule: str = "constant"
    """After warm-up: constant, or cosine decay to min_lr_ratio * lr at trainer.total_steps."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this before each optimizer step; null: no clipping."""
    mini_batch_size: int = 8
    """Rows (responses) per optimizer step over all data-parallel ranks; must divide data.batch_size * rollout.n."""
    ppo_epochs: int = 1
    """Passes over each step's rollout batch, each taking one optimizer step per mini-batch."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (docs/lora.md)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(self, "lr", self.lr > 0, "must be > 0")
        two_betas = len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas)
        _require(self, "betas", two_betas, "must be two numbers in [0, 1)")
        _at_least(self, 0, "weight_decay", "warmup_steps")
        _one_of(self, "lr_schedule", ("constant", "cosine"))
        _require(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        _require(self, "grad_clip", self.grad_clip is None or self.grad_clip > 0, "must be > 0 or null")
        _at_least(self, 1, "mini_batch_size", "ppo_epochs")


@dataclass
class ScoringRoleConfig(RoleConfig):
    kind: str = "rule"
    """rule: a Python function scores each response; model: the scoring model at model_path does."""
    rule: str = "auto"
    """With kind=rule, the function's name in the spmd_rlhf.rewards registry, or path/to/file.py:function (verl's
    signature); auto: chosen by each row's data_source."""
    rule_kwargs: dict | None = None
    """With kind=rule, keyword arguments for every call of the rule (verl's reward_kwargs), e.g. {strict: true,
    format_score: 0.1} for gsm8k (with rule=auto, every data source's function must take them); null: none."""
    num_workers: int = 0
    """With kind=rule, processes per rank that score rows in parallel (started once, reused); 0: score in the rank's
    own process, where a call cannot be stopped, so timeout_s does not apply."""
    timeout_s: float | None = 10.0
    """With kind=rule and num_workers >= 1, seconds one call may run before it is stopped and counts as a timeout;
    null: no limit."""
    on_error: str = "zero"
    """With kind=rule, a call that raises, times out or returns a non-finite number: zero (score 0, logged, counted
    in the <role>/errors, /timeouts and /non_finite metrics) or abort (stop with an error naming the function, the
    row's data source and the cause)."""
    max_failure_fraction: float | None = None
    """With kind=rule and on_error=zero, a step where more than this fraction of the calls failed stops the run,
    naming the counts (a reward that never works, e.g. rule=auto on a data_source it does not know, would train on
    zeros); null: stop only when every call of the step failed; 1.0: never."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _one_of(self, "kind", ("rule", "model"))
        fraction = self.max_failure_fraction
        _require(self, "max_failure_fraction", fraction is None or 0.0 <= fraction <= 1.0, "must be null or in [0, 1]")
        _require(self, "rule", self.rule != "", "must name a registered function or be auto")
        _at_least(self, 0, "num_workers")
        _require(self, "timeout_s", self.timeout_s is None or self.timeout_s > 0, "must be > 0 or null")
        _one_of(self, "on_error", ("zero", "abort"))


@dataclass
class RolloutConfig:
    n: int = 1
    """Responses sampled per prompt; grpo and rloo need at least 2 for their group baselines."""
    temperature: float = 1.0
    """Sampling temperature; 0: greedy."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0: all tokens."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to top_p; 1.0: all tokens."""
    max_new_tokens: int = 32
    """Most tokens generated per response (per turn of a multi-turn trajectory); generation also stops at EOS."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that also end a response (kept in it, like EOS), besides the tokenizer's EOS and any ids the model's
    generation_config.json lists as eos_token_id (as transformers' generate and vLLM stop on them): e.g. an
    end-of-turn id."""
    tp: int = 1
    """Tensor-parallel degree while generating (tp_g); must divide actor.tp: the other actor.tp / tp become replicas."""
    kv_block_size: int | None = None
    """Tokens per paged KV-cache block; null: 256 where generation runs flash-attn (CUDA, a 16-bit model.dtype and
    flash-attn installed: its paged kernel needs a multiple of 256), else 16."""
    memory_fraction: float = 0.5
    """Fraction of device memory generation may fill, resident weights included; the KV cache gets what is left."""
    kv_cache_blocks: int = 0
    """KV-cache blocks of each generation replica, a fixed budget (requests that do not fit wait or are preempted;
    with partial_rollouts, of each batch in flight); 0: on GPU what memory_fraction leaves (with partial_rollouts,
    split evenly among the algorithm.max_staleness batches in flight), elsewhere enough to run every request to full
    length at once."""
    max_num_seqs: int = 256
    """Most sequences decoded together by continuous batching."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs, one per batch-size bucket, where they apply (a CUDA replica of one rank
    whose decode attention is the Triton paged kernel); false: eager decode steps. Elsewhere decode is eager anyway."""
    environment: str | None = None
    """Multi-turn rollouts (docs/multiturn.md): the environment that answers each turn, ``tool`` (tool calls in the
    Hermes / Qwen format run on the sandboxed calculator and Python tools) or path/to/file.py:name (a class or
    function making a fresh Environment); null: single-turn responses."""
    max_turns: int = 1
    """With an environment: most policy turns per trajectory."""
    environment_workers: int = 16
    """With an environment: threads that answer a turn's trajectories at once (each has its own environment; the
    sandboxed tools run in subprocesses, so calls overlap); 1 answers them one after another. Results do not depend
    on it."""
    max_response_tokens: int | None = None
    """With an environment: most tokens per trajectory after the prompt, generated and observation tokens together
    (the width of the response rows); null: max_turns x max_new_tokens."""
    recompute_log_probs: bool = False
    """Recompute the rollouts' log-probs with a training forward pass; false uses the engine's, which are the same
    numbers (same model code; equal within 1e-6 in float32) and saves that pass."""
    enabled: bool = False
    """Generate on a rollout role of its own (generation-only replicas on their own ranks, fed the actor's weights
    by a mesh-to-mesh sync) instead of on the actor's devices; needs placement split, standalone or manual, and is
    what algorithm.max_staleness > 0 runs on. false: the actor generates (the synchronous HybridEngine path)."""
    pool: str | None = None
    """With enabled and placement=manual: the rollout role's resource pool."""
    n_ranks: int = 0
    """With enabled: ranks of the rollout role (replicas x tp); 0: all ranks of its pool."""
    sync_bucket_mb: float = 64.0
    """With enabled: MiB of weights (in model.dtype) per broadcast of the trainer-to-rollout weight sync."""
    background_sync: bool = False
    """With enabled: each actor rank copies its shards in model.dtype and a thread of its own sends them while the
    actor goes on training, instead of the actor waiting for the rollout to receive (which it does after the
    generation queued before the sync: with algorithm.max_staleness >= 2 a whole batch). Costs each actor rank its
    shards once more in model.dtype while a sync is in flight."""
    partial_rollouts: str = "off"
    """With algorithm.max_staleness > 0: generate each batch in segments of partial_segment_tokens, one per step it
    is in flight, so that weight syncs land between segments and the requests in flight go on under the new weights,
    each token tagged with its version: keep_kv (their K/V kept, AReaL-style), recompute_kv (their K/V recomputed
    under the new weights) or drop (restarted from the prompt: no response mixes versions). off: a batch generates
    whole under the version it was issued with."""
    partial_segment_tokens: int = 8
    """With partial_rollouts: tokens each unfinished request generates per segment (the last segment, issued when
    the step that trains on the batch comes, runs to the end)."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "n", "max_new_tokens", "tp", "max_num_seqs", "max_turns", "environment_workers")
        _require(
            self,
            "environment",
            self.environment is None or self.environment in ENVIRONMENTS or ".py:" in self.environment,
            f"must be null, {', '.join(ENVIRONMENTS)}, or path/to/file.py:name "
            "(a class or function making an Environment)",
        )
        _require(
            self,
            "max_turns",
            self.max_turns == 1 or self.environment is not None,
            "needs rollout.environment (a second turn answers an environment's observation)",
        )
        _require(
            self,
            "max_response_tokens",
            self.max_response_tokens is None or self.max_response_tokens >= self.max_new_tokens,
            f"must be null or at least rollout.max_new_tokens={self.max_new_tokens} (one whole turn)",
        )
        _require(
            self,
            "max_response_tokens",
            self.max_response_tokens is None or self.environment is not None,
            "needs rollout.environment (single-turn responses are max_new_tokens long)",
        )
        _require(self, "stop_token_ids", all(token >= 0 for token in self.stop_token_ids), "must be token ids >= 0")
        _require(self, "kv_block_size", self.kv_block_size is None or self.kv_block_size >= 1, "must be >= 1 or null")
        _at_least(self, 0, "temperature", "top_k", "kv_cache_blocks")
        _require(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        _require(self, "memory_fraction", 0 < self.memory_fraction <= 1, "must be in (0, 1]")
        _at_least(self, 0, "n_ranks")
        _require(self, "pool", self.pool != "", "must be a name or null")
        _require(self, "sync_bucket_mb", self.sync_bucket_mb > 0, "must be > 0")
        _require(
            self,
            "background_sync",
            self.enabled or not self.background_sync,
            "needs rollout.enabled=true (it sends the actor's weights to a rollout role)",
        )
        _one_of(self, "partial_rollouts", PARTIAL_ROLLOUTS)
        _at_least(self, 1, "partial_segment_tokens")

    # The rollout role's layout as placement and the checks read any role's (not keys: fixed for a rollout role):
    # one pipeline stage, its replicas are its DP degree, the actor's model (weights from the sync, never from
    # disk), and no training micro-batches.
    pp = 1
    dp = 0
    model_path = None
    max_tokens_per_micro_batch = None

    @property
    def response_length(self) -> int:
        """Width of the response rows: max_new_tokens, or a multi-turn trajectory's budget after its prompt."""
        if self.environment is None:
            return self.max_new_tokens
        return self.max_response_tokens or self.max_turns * self.max_new_tokens

    @property
    def response_length_keys(self) -> str:
        """The keys that set ``response_length``, as error messages name them."""
        if self.environment is None:
            return "rollout.max_new_tokens"
        if self.max_response_tokens is not None:
            return "rollout.max_response_tokens"
        return "rollout.max_turns x rollout.max_new_tokens"


LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""The modes of ``spmd_rlhf.algos.aggregate`` (a test keeps the two lists equal)."""


@dataclass
class AlgorithmConfig:
    name: str = "ppo"
    """ppo, grpo, remax, rloo, reinforce_pp (REINFORCE++), reinforce_pp_baseline (REINFORCE++ with a group-mean
    baseline) or safe_rlhf (PPO-Lagrangian with a cost model and a cost critic)."""
    gamma: float = 1.0
    """Discount factor of returns and GAE."""
    lam: float = 0.95
    """GAE lambda: 0 gives one-step TD advantages, 1 gives Monte Carlo returns minus values."""
    kl_coef: float = 0.01
    """Weight of the KL(actor || reference) term (the initial weight with kl_target)."""
    kl_target: float | None = None
    """Adaptive KL (Ziegler et al. 2019): steer the weight towards this mean per-sequence KL; null: fixed kl_coef."""
    kl_horizon: int = 10000
    """Adaptive KL: responses over which a full +/-20% correction of the weight is applied."""
    kl_estimator: str = "k1"
    """Per-token KL estimate from r = pi_ref / pi (Schulman): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    kl_penalty: str = "reward"
    """Where the KL term goes: reward (subtracted from per-token rewards), loss (added to the policy loss) or none."""
    clip_ratio_low: float = 0.2
    """The policy ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]."""
    clip_ratio_high: float = 0.2
    """Upper side of the ratio clip; raise it (e.g. 0.28) for DAPO's clip-higher."""
    value_clip: float | None = 0.2
    """Critic loss: clip new values to old values +/- this; null: no clipping."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    normalize_advantages: bool = True
    """Whiten advantages over the batch; for grpo, divide each group by its std (false gives Dr. GRPO)."""
    loss_aggregation: str = "token_mean"
    """Per-token losses to one number over the global batch: token_mean, seq_mean_token_mean, seq_mean_token_sum or
    seq_mean_token_sum_norm (Dr. GRPO: divide by sequences x max response length)."""
    policy_loss: str = "ppo"
    """Importance ratio of the clipped policy loss: ppo (per token) or gspo (per sequence, Zheng et al. 2025; use
    small clip ratios such as 3e-4 / 4e-4)."""
    dynamic_sampling: bool = False
    """DAPO: drop prompts whose samples all scored the same and refill the batch from further prompts (grpo family)."""
    max_sampling_rounds: int = 3
    """DAPO dynamic sampling: generation rounds per step at most; a batch still short after them is used as it is."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the last this many tokens before rollout.max_new_tokens cost up to
    overlong_penalty linearly; 0: off."""
    overlong_penalty: float = 1.0
    """DAPO: the score subtracted from a response of rollout.max_new_tokens tokens when overlong_buffer > 0."""
    cost_limit: float = 0.0
    """safe_rlhf: the expected cost the policy must stay under (threshold d of the Lagrangian)."""
    lambda_init: float = 1.0
    """safe_rlhf: initial Lagrange multiplier of the cost constraint (> 0; it is log-parameterised)."""
    lambda_lr: float = 0.1
    """safe_rlhf: learning rate of the Lagrange multiplier."""
    lambda_max: float | None = None
    """safe_rlhf: upper bound of the Lagrange multiplier; null: none."""
    max_staleness: int = 0
    """Asynchronous RL: how many policy updates a step's samples may lag the policy they train (k). 0: every step
    trains on samples of its own weights (synchronous); 1: one-step-off (the next batch is generated while this one
    trains); k: a k-deep pipeline. k > 0 needs rollout.enabled and rollout.recompute_log_probs."""
    off_policy_correction: str = "truncated"
    """With max_staleness > 0, the importance weight w = pi_old / pi_behaviour (recomputed over engine log-probs) of
    each token: truncated (min(w, importance_cap)) or masked (tokens with w > importance_cap leave the loss)."""
    importance_cap: float = 2.0
    """With max_staleness > 0: the cap of the importance weights (> 1)."""

    def __post_init__(self) -> None:
        _one_of(self, "name", ALGORITHMS)
        for name in ("gamma", "lam"):
            _require(self, name, 0 <= getattr(self, name) <= 1, "must be in [0, 1]")
        _at_least(self, 0, "kl_coef", "entropy_coef", "lambda_init")
        _at_least(self, 1, "kl_horizon")
        _require(self, "kl_target", self.kl_target is None or self.kl_target > 0, "must be > 0 or null")
        _one_of(self, "kl_estimator", ("k1", "k2", "k3"))
        _one_of(self, "kl_penalty", ("reward", "loss", "none"))
        _require(self, "clip_ratio_low", 0 < self.clip_ratio_low < 1, "must be in (0, 1)")
        _require(self, "clip_ratio_high", self.clip_ratio_high > 0, "must be > 0")
        _require(self, "value_clip", self.value_clip is None or self.value_clip > 0, "must be > 0 or null")
        _one_of(self, "loss_aggregation", LOSS_AGGREGATIONS)
        _require(self, "lambda_lr", self.lambda_lr > 0, "must be > 0")
        _require(self, "lambda_init", self.lambda_init > 0, "must be > 0 (the multiplier is log-parameterised)")
        _one_of(self, "policy_loss", ("ppo", "gspo"))
        _at_least(self, 1, "max_sampling_rounds")
        _at_least(self, 0, "overlong_buffer", "overlong_penalty", "max_staleness")
        _one_of(self, "off_policy_correction", ("truncated", "masked"))
        _require(self, "importance_cap", self.importance_cap > 1, "must be > 1")
        rule = f"dynamic sampling filters groups of samples; use {_listed(GROUP_ALGORITHMS)}"
        _require(self, "dynamic_sampling", not self.dynamic_sampling or self.name in GROUP_ALGORITHMS, rule)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["tiny/task/train.parquet"])
    """Training prompt files, parquet or JSONL, in verl's row schema."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompt files; empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: chat messages (a list of {role, content}) or plain text."""
    max_prompt_length: int = 64
    """Most prompt tokens, chat template included; longer prompts are handled as overlong_prompts says."""
    overlong_prompts: str = "error"
    """A prompt over max_prompt_length: error (stop, naming the row), skip (drop it, counted as data/skipped_prompts)
    or truncate (keep its last max_prompt_length tokens, counted as data/truncated_prompts)."""
    batch_size: int = 8
    """Prompts per training step over all ranks; the step trains on batch_size * rollout.n responses."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch."""
    seed: int = 0
    """Seed of the shuffling order."""

    def __post_init__(self) -> None:
        _require(self, "train_files", bool(self.train_files), "must list at least one file")
        _require(self, "prompt_key", self.prompt_key != "", "must name a column")
        _at_least(self, 1, "max_prompt_length", "batch_size")
        _one_of(self, "overlong_prompts", ("error", "skip", "truncate"))


@dataclass
class TrainerConfig:
    total_steps: int = 20
    """Training steps to run, each one rollout batch and its updates."""
    output_dir: str = "outputs/run"
    """Directory for checkpoints, metrics and the resolved config."""
    seed: int = 0
    """Seed of initialization and sampling."""
    save_every: int | None = None
    """Save a checkpoint every this many steps and after the last; null: every tenth of total_steps (at least every
    step); 0: only after the last step (and on save_every_minutes and signals)."""
    save_every_minutes: float = 30.0
    """Also save after the first step that ends this many minutes after the previous save (or the run's start), so a
    crash loses at most about this much work; 0: no time-based saves."""
    keep_last: int = 3
    """Keep this many checkpoints of highest step in output_dir, deleting older ones after each save (never the one
    latest names); 0: keep every checkpoint."""
    stop_timeout_s: float = 100.0
    """On SIGTERM or SIGUSR1 the run finishes the step in flight, saves and exits with code 75 (recipes/slurm requeues
    on it); a stop that takes longer than this exits with code 75 without saving (the last checkpoint stands). Keep it
    below the grace the launcher gives (torchrun --shutdown-timeout, SLURM --signal=B:USR1@SECONDS)."""
    save_hf: str = "final"
    """Which checkpoints also hold each trained role's weights as a Hugging Face directory (<step>/<role>, streamed
    from the shards; resume only needs the sharded state): final (the save after the last step), every or never
    (spmd-rlhf export writes one from any checkpoint later)."""
    save_hf_dtype: str | None = None
    """Dtype of those Hugging Face copies: null (model.dtype), float32 (the trained roles' float32 master weights,
    unrounded, at twice the bytes of bfloat16), bfloat16 or float16."""
    log_every: int = 1
    """Log metrics every this many steps."""
    max_skipped_steps: int = 10
    """A trained role skips an optimizer step whose gradient norm is not finite (counted in <role>/skipped_steps);
    more than this many consecutive skipped steps stop the run, naming the step and the role's update."""
    val_every: int = 0
    """Validate every this many steps (needs data.val_files): a greedy response per prompt; 0: never."""
    val_samples: int = 0
    """Validation also samples this many responses per prompt (rollout temperature): val/sampled/reward/mean and
    val/pass@k (k = val_samples, unbiased estimator); 0: greedy only."""
    val_pass_score: float = 1.0
    """A sampled validation response passes (for pass@k) when its score is at least this."""
    resume: str | None = "auto"
    """auto: continue from output_dir's latest checkpoint if there is one; null: start fresh (refused when output_dir
    holds checkpoints); else a checkpoint dir. A checkpoint that already reached total_steps is refused."""
    resume_allow_changes: bool = False
    """Resume even when the config changes the data order (data.train_files, shuffle, seed, batch_size, prompt_key) or
    the models (model.path, tokenizer_path, critic/cost_critic.model_path) from the checkpoint's saved config."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks, any of: console (progress line), jsonl (<output_dir>/metrics.jsonl, read by spmd-rlhf plot;
    written whether listed or not), tensorboard (<output_dir>/tensorboard; pip install tensorboard) and wandb
    (pip install wandb; WANDB_MODE=offline works)."""
    timing_every: int = 50
    """Print a table of each stage's mean seconds and share of the step every this many steps and after the last
    (console logger); 0: never."""
    peak_flops_per_device: float = 0.0
    """Peak FLOP/s of one device at the training dtype, for the perf/mfu metric, e.g. 989e12 for an H100 SXM in dense
    bf16; 0: unknown, perf/mfu is not logged."""
    wandb_project: str = "spmd_rlhf"
    """wandb project of the run (wandb logger)."""
    wandb_run_name: str | None = None
    """wandb run name (wandb logger); null: the name of output_dir."""
    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda (one GPU per rank, NCCL; an error without CUDA) or cpu
    (gloo only, even on a GPU machine)."""
    host_huge_pages: bool = True
    """On CPU, each rank restarts itself once at start with glibc's glibc.malloc.hugetlb=1 tunable where the kernel's
    transparent huge pages are in madvise mode (runtime/host_memory.py): large transient tensors are then faulted in
    2 MiB pages instead of 4 KiB ones (docs/benchmarks.md measures the gain). No effect on GPU ranks."""
    timeout_s: float = 600.0
    """Seconds the controller waits for a remote call (and for a step's calls together) before the job fails, naming
    the call still running; collectives have their own collective_timeout_s."""
    collective_timeout_s: float = 600.0
    """Seconds a collective (or point-to-point transfer) may wait for its peers before it fails on the ranks in it."""

    def __post_init__(self) -> None:
        _at_least(self, 1, "total_steps", "log_every")
        _at_least(self, 0, "val_samples", "max_skipped_steps")
        _at_least(self, 0, "val_every", "timing_every", "peak_flops_per_device", "save_every_minutes", "keep_last")
        _require(self, "save_every", self.save_every is None or self.save_every >= 0, "must be >= 0 or null")
        _require(self, "stop_timeout_s", self.stop_timeout_s > 0, "must be > 0")
        _require(self, "output_dir", self.output_dir != "", "must name a directory")
        _require(self, "wandb_project", self.wandb_project != "", "must name a wandb project")
        _require(self, "resume", self.resume != "", "must be auto, null or a checkpoint directory")
        loggers = ("console", "jsonl", "tensorboard", "wandb")
        _require(self, "loggers", set(self.loggers) <= set(loggers), "allowed: " + ", ".join(loggers))
        _one_of(self, "device", DEVICE_SETTINGS)
        _one_of(self, "save_hf", ("final", "every", "never"))
        _require(
            self,
            "save_hf_dtype",
            self.save_hf_dtype in (None, "float32", "bfloat16", "float16"),
            "must be null (model.dtype), float32, bfloat16 or float16",
        )
        _require(self, "timeout_s", self.timeout_s > 0, "must be > 0")
        _require(self, "collective_timeout_s", self.collective_timeout_s > 0, "must be > 0")

    def steps_between_saves(self) -> int:
        """``save_every`` resolved: null becomes a tenth of ``total_steps`` (at least 1); 0 stays 0."""
        return max(1, self.total_steps // 10) if self.save_every is None else self.save_every


@dataclass
class MappingConfig:
    profile: str = "auto"
    """Device profile for placement=auto: h100, a100, a JSON file written by `spmd-rlhf calibrate`, or auto (the
    calibrated profile at ~/.cache/spmd_rlhf/device_profile.json or $SPMD_RLHF_PROFILE, else the built-in one named in
    the GPU's name, else a quick calibration of this machine)."""
    gpus_per_node: int = 0
    """Devices per node for placement=auto; 0: torchrun's LOCAL_WORLD_SIZE (every rank when it is not set)."""

    def __post_init__(self) -> None:
        _require(self, "profile", self.profile != "", "must be auto, a built-in profile name or a profile file")
        _at_least(self, 0, "gpus_per_node")


@dataclass
class FrameworkConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model and how every model runs."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets and batching."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm and its loss and advantage settings."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation: sampling and the engine; with rollout.enabled, the rollout role that generates on ranks
    of its own (asynchronous RL)."""
    placement: str = "colocate"
    """Roles on devices: colocate (one pool), split (actor+reference | rest, a rollout role included), standalone,
    manual (by pool), or auto (the device mapper picks the pools and every role's pp/tp and rollout.tp; see mapping)."""
    mapping: MappingConfig = field(default_factory=MappingConfig)
    """How placement=auto models the devices."""
    actor: TrainableRoleConfig = field(default_factory=TrainableRoleConfig)
    """The policy being trained; it also generates the rollouts."""
    critic: TrainableRoleConfig = field(default_factory=lambda: TrainableRoleConfig(lr=1e-4))
    """Value model trained alongside the actor (ppo, safe_rlhf)."""
    reference: RoleConfig = field(default_factory=RoleConfig)
    """Frozen copy of the initial policy for the KL term."""
    reward: ScoringRoleConfig = field(default_factory=ScoringRoleConfig)
    """Scores each response: a rule function or a reward model."""
    cost: ScoringRoleConfig = field(default_factory=lambda: ScoringRoleConfig(enabled=False, kind="model"))
    """Safe-RLHF cost model: scores how harmful each response is (safe_rlhf only)."""
    cost_critic: TrainableRoleConfig = field(default_factory=lambda: TrainableRoleConfig(enabled=False, lr=1e-4))
    """Safe-RLHF cost value model, trained on the cost returns beside the reward critic (safe_rlhf only)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Step count, checkpoints, logging and the run's directory."""

    def __post_init__(self) -> None:
        _one_of(self, "placement", PLACEMENTS)
        self._check_roles_match_algorithm()
        for name, role in self.enabled_roles().items():
            _check_layout(self, name, role)
        self._check_pools()
        _require(self, "rollout.tp", self.actor.tp % self.rollout.tp == 0, f"must divide actor.tp={self.actor.tp}")
        self._check_kv_cache()
        if self.algorithm.name in GROUP_ALGORITHMS:
            rule = f"algorithm.name={self.algorithm.name} needs >= 2 responses per prompt for its group baseline"
            _require(self, "rollout.n", self.rollout.n >= 2, rule)
            rule = (
                f"algorithm.name={self.algorithm.name} compares a prompt's responses with each other, and greedy "
                f"decoding makes them all the same (every advantage 0); set a sampling temperature > 0, e.g. 1.0"
            )
            _require(self, "rollout.temperature", self.rollout.temperature > 0, rule)
        self._check_training_batches()
        self._check_token_budgets()
        self._check_asynchronous()
        for name in ("reward", "cost"):
            role = getattr(self, name)
            if role.enabled and role.kind == "model":
                rule = f"{name}.kind=model needs the directory of a trained {name} model"
                _require(self, f"{name}.model_path", role.model_path is not None, rule)
        rule = "needs data.val_files; list validation files or set trainer.val_every=0"
        _require(self, "trainer.val_every", self.trainer.val_every == 0 or bool(self.data.val_files), rule)

    def enabled_roles(self) -> dict[str, RoleConfig]:
        """The roles this run creates, by name, in ``ROLES`` order."""
        return {name: getattr(self, name) for name in ROLES if getattr(self, name).enabled}

    def resource_pools(self) -> dict[str, list[str]]:
        """Pool name -> the enabled roles placed on it; empty for placement=auto, where the device mapper decides."""
        roles = list(self.enabled_roles())
        match self.placement:
            case "colocate":
                return {"all": roles}
            case "split":
                # The policy models (actor, reference) on one pool, the models that score them on the other; a
                # rollout role generates beside the scorers, so its samples are scored where they are.
                policy = [
                    name for name in roles if ROLE_KINDS[name].head == "lm" and ROLE_KINDS[name].worker != "rollout"
                ]
                return {"policy": policy, "scoring": [name for name in roles if name not in policy]}
            case "standalone":
                return {name: [name] for name in roles}
            case "manual":
                pools: dict[str, list[str]] = {}
                for name in roles:
                    pools.setdefault(getattr(self, name).pool, []).append(name)
                return pools
        return {}

    def _check_roles_match_algorithm(self) -> None:
        # An enabled role the algorithm never calls would hold devices for nothing; say so rather than idle.
        flow = dataflow.dataflow_of(self.algorithm.name)
        for role in ROLES:
            used, by = flow.requirement(role, self)
            verb = "needs" if used else "never calls"
            rule = f"{by} {verb} the {role}; set {role}.enabled={format_value(used)}"
            _require(self, f"{role}.enabled", getattr(self, role).enabled == used, rule)

    def _check_pools(self) -> None:
        for name, role in self.enabled_roles().items():
            if self.placement == "manual":
                _require(self, f"{name}.pool", role.pool is not None, "placement=manual needs a pool for every role")
            else:
                rule = f"only used with placement=manual (placement={self.placement}); set {name}.pool=null"
                _require(self, f"{name}.pool", role.pool is None, rule)
        for pool, members in self.resource_pools().items():
            sized = [name for name in members if getattr(self, name).n_ranks]
            for name in sized[1:]:
                first_n_ranks = getattr(self, sized[0]).n_ranks
                rule = (
                    f"must equal {sized[0]}.n_ranks={first_n_ranks}; "
                    f"roles sharing a pool (here {pool}, placement={self.placement}) span all of its ranks"
                )
                _require(self, f"{name}.n_ranks", getattr(self, name).n_ranks == first_n_ranks, rule)

    def _check_asynchronous(self) -> None:
        rollout, staleness = self.rollout, self.algorithm.max_staleness
        if rollout.enabled:
            rule = (
                f"the rollout role generates on ranks of its own; use placement=split (actor and reference | "
                f"rollout and scorers), standalone or manual, or set rollout.enabled=false "
                f"(placement={self.placement})"
            )
            _require(self, "placement", self.placement in ("split", "standalone", "manual"), rule)
            rule = "the rollout receives the actor's weights from one pipeline; set actor.pp=1 with rollout.enabled"
            _require(self, "actor.pp", self.actor.pp == 1, rule)
            rule = (
                "the weight sync sends the trained weights, not LoRA adapters merged into them; set "
                "actor.lora.rank=0 or rollout.enabled=false"
            )
            _require(self, "actor.lora.rank", not self.actor.lora.enabled, rule)
            rule = "multi-turn environments run on the actor's generation only; set rollout.enabled=false with them"
            _require(self, "rollout.environment", rollout.environment is None, rule)
            rule = "draws extra batches on the actor's devices, synchronously; set it false with rollout.enabled=true"
            _require(self, "algorithm.dynamic_sampling", not self.algorithm.dynamic_sampling, rule)
        if staleness:
            rule = (
                f"algorithm.max_staleness={staleness} generates on a rollout role of its own; set rollout.enabled=true"
            )
            _require(self, "rollout.enabled", rollout.enabled, rule)
            rule = (
                f"algorithm.max_staleness={staleness} corrects stale samples with pi_old / pi_behaviour, which "
                f"needs the log-probs recomputed under the current policy; set rollout.recompute_log_probs=true"
            )
            _require(self, "rollout.recompute_log_probs", rollout.recompute_log_probs, rule)
        rule = (
            "a response can only span a weight update when batches are generated ahead; set "
            "algorithm.max_staleness >= 1 (and rollout.enabled=true), or rollout.partial_rollouts=off"
        )
        _require(self, "rollout.partial_rollouts", rollout.partial_rollouts == "off" or staleness >= 1, rule)

    def _check_kv_cache(self) -> None:
        rollout = self.rollout
        if not rollout.kv_cache_blocks:
            return
        longest = self.data.max_prompt_length + rollout.response_length
        block_size = rollout.kv_block_size or DEFAULT_KV_BLOCK_SIZE
        needed = -(-longest // block_size)
        rule = (
            f"holds {rollout.kv_cache_blocks * block_size} tokens, fewer than one sequence of "
            f"data.max_prompt_length + {rollout.response_length_keys} = {longest}; set it to at least {needed} "
            f"(blocks of {block_size} tokens: rollout.kv_block_size={format_value(rollout.kv_block_size)}) or 0 to "
            f"size the cache for every request"
        )
        _require(self, "rollout.kv_cache_blocks", rollout.kv_cache_blocks >= needed, rule)

    def _check_token_budgets(self) -> None:
        longest = self.data.max_prompt_length + self.rollout.response_length
        for name, role in self.enabled_roles().items():
            budget = role.max_tokens_per_micro_batch
            rule = (
                f"must hold the longest row, data.max_prompt_length + {self.rollout.response_length_keys} = {longest}; "
                f"set it to at least {longest} or null"
            )
            _require(self, f"{name}.max_tokens_per_micro_batch", budget is None or budget >= longest, rule)

    def _check_training_batches(self) -> None:
        rows = self.data.batch_size * self.rollout.n
        for name in ("actor", "critic"):
            role = getattr(self, name)
            if not role.enabled:
                continue
            key = f"{name}.mini_batch_size"
            _require(self, key, rows % role.mini_batch_size == 0, f"must divide data.batch_size*rollout.n={rows}")
            # Every data-parallel rank runs whole micro-batches of each mini-batch.
            dp = role.dp_size()
            per_pass = role.micro_batch_size * (dp or 1)
            unit = f"{name}.micro_batch_size*dp={per_pass}" if dp else f"{name}.micro_batch_size={per_pass}"
            _require(self, key, role.mini_batch_size % per_pass == 0, f"must be a multiple of {unit}")
            rule = f"must be <= trainer.total_steps={self.trainer.total_steps}"
            _require(self, f"{name}.warmup_steps", role.warmup_steps <= self.trainer.total_steps, rule)


def _check_layout(config: FrameworkConfig, name: str, role: RoleConfig) -> None:
    n_ranks = role.n_ranks
    if not n_ranks:
        return  # the pool's size is only known at start
    _require(config, f"{name}.tp", n_ranks % role.tp == 0, f"must divide {name}.n_ranks={n_ranks}")
    model_parallel = role.pp * role.tp
    rule = f"{name}.pp*{name}.tp={model_parallel} must divide {name}.n_ranks={n_ranks}"
    _require(config, f"{name}.pp", n_ranks % model_parallel == 0, rule)
    rule = (
        f"{name}.pp*{name}.dp*{name}.tp must equal {name}.n_ranks={n_ranks}; "
        f"set {name}.dp={n_ranks // model_parallel} or 0 to derive it"
    )
    _require(config, f"{name}.dp", role.dp in (0, n_ranks // model_parallel), rule)


def _require(section: object, key: str, ok: bool, rule: str) -> None:
    """Raise ``key=<its value in section>: rule`` unless ``ok``; ``key`` is dotted relative to ``section``."""
    if not ok:
        value = functools.reduce(getattr, key.split("."), section)
        raise ConfigError(f"{key}={format_value(value)}: {rule}")


def _at_least(section: object, minimum: int, *names: str) -> None:
    for name in names:
        _require(section, name, getattr(section, name) >= minimum, f"must be >= {minimum}")


def _one_of(section: object, name: str, choices: tuple[str, ...]) -> None:
    _require(section, name, getattr(section, name) in choices, "must be one of " + ", ".join(choices))


def _listed(names: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def format_value(value: object) -> str:
    """A value as it is written in YAML or an override (null, true, [0.9, 0.999]), so messages can be copied back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(item) for item in value) + "]"
    if value == "":
        return '""'
    return str(value)
