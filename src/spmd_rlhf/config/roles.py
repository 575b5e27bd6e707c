"""The role sections: every role's layout and batch sizes (``RoleConfig``), a trained role's optimizer and LoRA
(``TrainableRoleConfig``, ``LoRAConfig``), and a scoring role's rule or model (``ScoringRoleConfig``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from spmd_rlhf.config.choices import (
    CP_ATTENTION,
    LORA_TARGETS,
)
from spmd_rlhf.config.errors import at_least, one_of, require
from spmd_rlhf.config.judge import DEFAULT_JUDGE_TEMPLATE, judge_template_problem, score_pattern_problem


@dataclass
class RoleConfig:
    enabled: bool | None = None
    """Run this role; null: when the algorithm's step calls it (GRPO has no critic, only safe_rlhf has a cost model,
    LoRA with no reference model_path makes the actor's base the reference); true or false must agree with that."""
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
    """Tensor-parallel degree (heads, MLP and expert widths, vocabulary: docs/parallelism.md)."""
    sequence_parallel: bool = False
    """With tp > 1 (Megatron's sequence parallelism): between the TP-split layers each TP rank keeps 1 / tp of a
    micro-batch's tokens, so the residual stream, the norms and what they keep for the backward are split instead
    of replicated over tp, for the same bytes on the wire (all-gathers and reduce-scatters where the all-reduces
    were). Dense and mixture-of-experts models, with pipeline stages, context parallelism and LoRA
    (docs/parallelism.md); trained and scoring roles, not generation; no effect at tp = 1 (so that placement=auto may
    choose it)."""
    ep: int = 1
    """Expert-parallel degree of a mixture-of-experts model, borrowed from dp (it must divide dp, and the model's
    expert count): each MoE layer's experts are split over ep consecutive DP ranks (each expert's width over tp as
    well when tp > 1), tokens sent to their experts and back by all-to-all, and FSDP shards each share over the
    dp / ep ranks holding it; attention, norms and the vocabulary stay FSDP-sharded over all of dp. 1: every DP rank
    runs every expert (FSDP-sharded over dp)."""
    cp: int = 1
    """Context-parallel degree, borrowed from dp (it must divide dp): the cp consecutive DP ranks of a group keep their
    own rows but run every micro-batch of the group together, each rank a 1/cp chunk of its packed row, so no rank
    holds a whole long row's activations; a row's per-token outputs are gathered to the rank that owns it.
    max_tokens_per_micro_batch then bounds each rank's chunk (a row may be cp times longer). Attention over the whole
    row: cp_attention. Composes with tp, pp and ep; mixture-of-experts models' router losses are the whole row's
    (docs/parallelism.md)."""
    fsdp_size: int = 0
    """FSDP's shard group (HSDP, verl's fsdp_size): 0 shards every parameter over all dp ranks; a divisor of dp
    shards over that many consecutive DP ranks (on the same node while fsdp_size x tp fits one) and keeps dp /
    fsdp_size replicas, so FSDP's all-gathers and reduce-scatters stay on the node's links and only the gradients'
    all-reduce across replicas crosses nodes; each rank then holds 1 / fsdp_size of the state, not 1 / dp (a
    streamed vocabulary streams within the group)."""
    cp_attention: str = "auto"
    """How attention reads the whole row under cp > 1: ulysses (all-to-all from sequence chunks to head groups around
    each attention call; cp must divide each rank's heads / tp, key/value heads replicated up to cp), ring (zig-zag
    chunks, keys and values passed around the ring with an online softmax, any cp; scores computed in float32 tiles,
    not by a fused kernel), or auto: ulysses where cp divides the heads, else ring."""
    micro_batch_size: int = 4
    """Rows (responses) per forward and backward pass of training on each data-parallel rank."""
    forward_micro_batch_size: int = 0
    """Rows per forward-only pass (log-probs, values, scores), which keeps no activations; 0: micro_batch_size."""
    max_tokens_per_micro_batch: int | None = 0
    """Token budget of one micro-batch on each data-parallel rank, for training and forward-only passes alike (verl's
    ppo_max_token_len_per_gpu): rows are grouped into as few micro-batches of nearly equal token counts as fit it, so
    short responses share a pass and long ones get their own; every DP rank runs the same number. Must hold the
    longest row (data.max_prompt_length + rollout.max_new_tokens). 0 (the default): on GPU derived for each pass from
    the device's free memory and what a token of that pass holds (training.token_budget; row micro-batches where
    that cannot hold the longest row), elsewhere as null (an H100 ran the 1.5B update at 39-42 % MFU with it, against
    20-37 % with micro-batches of 2 rows: docs/benchmarks.md). null: micro_batch_size / forward_micro_batch_size rows
    per micro-batch.
    Either way a micro-batch is fed as one packed sequence of its rows' real tokens (no padding rows; with pp > 1, a
    few padding tokens give every micro-batch the same shapes)."""
    fsdp_unit_mb: float = 32.0
    """FSDP gathers (and reduce-scatters gradients of) one unit at a time, each at a fixed latency: consecutive decoder
    layers share a unit until it holds at least this many MiB of this rank's TP shard, so real shapes (a 0.5B layer is
    about 60 MB in float32) keep one layer per unit, and a model smaller than this is one unit with no per-layer
    collectives. Gathered memory grows to about this size per unit. 0: one unit per layer."""
    offload: bool = False
    """GPU: keep parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy), each block
    copied to the device for its forward and backward, so colocated roles leave the device to each other."""
    forward_gather_mb: float | None = 4096.0
    """Forward-only passes (log-probs, reference log-probs, values, scores) keep each FSDP unit gathered from the
    call's first micro-batch to its end, one gather per unit per call instead of one per micro-batch (at dp = 1 a copy
    each), when the gathered parameters take at most this many MiB per rank: this rank's TP shard of the stage's
    parameters in model.dtype (1 GiB at 0.5B and 3 GiB at 1.5B in bf16). null: always; 0: never (FSDP's default).
    Never with pp > 1 or offload."""

    def __post_init__(self) -> None:
        at_least(self, 0, "n_ranks", "dp", "fsdp_size", "forward_micro_batch_size", "fsdp_unit_mb")
        gathered = self.forward_gather_mb
        require(self, "forward_gather_mb", gathered is None or gathered >= 0, "must be >= 0 or null")
        at_least(self, 1, "pp", "tp", "ep", "cp", "micro_batch_size")
        require(self, "pool", self.pool != "", "must be a name or null")
        require(self, "pp_schedule", self.pp_schedule in ("1f1b", "gpipe"), "must be 1f1b or gpipe")
        one_of(self, "cp_attention", CP_ATTENTION)
        budget = self.max_tokens_per_micro_batch
        require(self, "max_tokens_per_micro_batch", budget is None or budget >= 0, "must be >= 0 or null")

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
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski 2023, PEFT's use_rslora): scale by alpha / sqrt(rank) instead."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Ranks of some layers instead of rank, by PEFT's rule: a key is a regular expression that must match the end of
    the layer's full name after a dot, e.g. {q_proj: 8} or {layers.0.self_attn.v_proj: 2}; the first key that
    matches wins."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Alphas of some layers instead of alpha, matched like rank_pattern."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Which linear layers of every decoder layer get adapters, by PEFT's names: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj, or [all-linear] for all of them."""
    adapter_path: str | None = None
    """Start from an existing PEFT adapter directory (adapter_config.json + adapter_model.safetensors) instead of fresh
    adapters (B = 0); its rank, alpha, use_rslora, rank_pattern, alpha_pattern and target modules must match these
    keys. A DoRA adapter, or one whose target_modules is a regular expression, is refused."""

    def __post_init__(self) -> None:
        require(self, "rank", self.rank is None or self.rank >= 0, "must be >= 0 or null (0 and null: LoRA off)")
        require(self, "alpha", self.alpha > 0, "must be > 0")
        require(self, "dropout", 0 <= self.dropout < 1, "must be in [0, 1)")
        targets = self.target_modules
        allowed = targets == ["all-linear"] or (bool(targets) and set(targets) <= set(LORA_TARGETS))
        require(
            self, "target_modules", allowed, "must be [all-linear] or a non-empty list of " + ", ".join(LORA_TARGETS)
        )
        ranks, alphas = self.rank_pattern, self.alpha_pattern
        valid_ranks = _are_regular_expressions(ranks) and all(rank >= 1 for rank in ranks.values())
        require(self, "rank_pattern", valid_ranks, "must map regular expressions over layer names to ranks >= 1")
        valid_alphas = _are_regular_expressions(alphas) and all(alpha > 0 for alpha in alphas.values())
        require(self, "alpha_pattern", valid_alphas, "must map regular expressions over layer names to alphas > 0")
        require(self, "adapter_path", self.adapter_path != "", "must be a PEFT adapter directory or null")
        require(self, "adapter_path", self.adapter_path is None or self.enabled, "needs rank >= 1 (LoRA on)")

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted layers' names, all-linear expanded."""
        return LORA_TARGETS if self.target_modules == ["all-linear"] else tuple(self.target_modules)

    def rank_of(self, layer: str) -> int:
        """The adapter rank of ``layer``, a full module name (``model.layers.0.self_attn.q_proj``)."""
        return _pattern_value(self.rank_pattern, layer, self.rank)

    def scale_of(self, layer: str) -> float:
        """What ``layer``'s adapter output ``B A x`` is multiplied by: its alpha over its rank, or over the rank's
        square root with use_rslora."""
        rank = self.rank_of(layer)
        alpha = _pattern_value(self.alpha_pattern, layer, self.alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _pattern_value(patterns: dict[str, float], layer: str, default: float) -> float:
    """PEFT's rule for rank_pattern and alpha_pattern: the value of the first key that, as a regular expression, matches
    all of ``layer`` or its end after a dot; ``default`` when none does."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{key})", layer):
            return value
    return default


def _are_regular_expressions(patterns: dict[str, float]) -> bool:
    try:
        return all(key and re.compile(key) for key in patterns)
    except (re.error, TypeError):
        return False


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
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: weight of the routers' load-balancing loss (Switch / Mixtral: num_experts * sum over
    experts of the fraction of token choices times the mean router probability, per MoE layer over the micro-batch's
    real tokens, averaged over layers) added to the role's loss; null: the model config's router_aux_loss_coef (0
    without one). A nonzero value on a dense model is refused (docs/models.md)."""
    router_z_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the routers' z-loss (ST-MoE: the mean of logsumexp(router logits)^2, per
    MoE layer, averaged over layers) added to the role's loss. A nonzero value on a dense model is refused."""
    unsharded_accumulation_mb: float | None = 4096.0
    """Keep a mini-batch's parameters gathered and its gradients unsharded across its micro-batches, with one FSDP
    gather per unit in the first forward and one gradient reduce-scatter in the last backward (otherwise each
    micro-batch gathers every unit in its forward and again in its backward, and reduce-scatters it: at dp = 1, only
    copies), when that holds at most this many MiB more per rank than FSDP does: this rank's TP shard of the stage's
    parameters in model.dtype and of its trained parameters' gradients in float32, less the 1/dp of those gradients
    FSDP keeps anyway (2 bytes per parameter at dp = 1 with bf16, 5.5 at dp = 8: 3 GiB and 8 GiB at 1.5B). null:
    always; 0: only where it costs nothing (a model of one FSDP unit, gathered whole anyway). Never with pp > 1 or
    offload."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, "lr", self.lr > 0, "must be > 0")
        two_betas = len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas)
        require(self, "betas", two_betas, "must be two numbers in [0, 1)")
        at_least(self, 0, "weight_decay", "warmup_steps")
        one_of(self, "lr_schedule", ("constant", "cosine"))
        require(self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]")
        require(self, "grad_clip", self.grad_clip is None or self.grad_clip > 0, "must be > 0 or null")
        at_least(self, 1, "mini_batch_size", "ppo_epochs")
        aux = self.router_aux_loss_coef
        require(self, "router_aux_loss_coef", aux is None or aux >= 0, "must be >= 0 or null")
        at_least(self, 0, "router_z_loss_coef")
        budget = self.unsharded_accumulation_mb
        require(self, "unsharded_accumulation_mb", budget is None or budget >= 0, "must be >= 0 or null")


@dataclass
class ScoringRoleConfig(RoleConfig):
    kind: str = "rule"
    """rule: a Python function scores each response; model: the scoring model at model_path does; remote: a service at
    url does (batches of rows POSTed as JSON, scores back: spmd_rlhf.rewards.remote, docs/rewards.md); generative: the
    causal LM at model_path (a judge) writes a verdict through the generation engine, and judge_score_pattern reads
    the score from it (spmd_rlhf.rewards.judge)."""
    tokenizer_path: str | None = None
    """With kind=model or generative, the directory of the tokenizer the scoring model was trained with, where
    model_path holds none or another one; null: model_path's own tokenizer files, else the policy's. With kind=model,
    a tokenizer whose vocabulary or chat template differs from the policy's engages the foreign path: each response
    is decoded, the conversation (the row's prompt messages and the response) rebuilt with this tokenizer's chat
    template and tokenized again, and its score lands on the policy's last response token as any score does
    (docs/rewards.md). A judge always reads text in its own tokenizer's chat template."""
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
    url: str | None = None
    """With kind=remote (required there, refused with the other kinds), the http:// or https:// URL of the reward
    service that rows are POSTed to."""
    remote_batch_size: int = 64
    """With kind=remote, rows per request; each rank sends its share of the rows one request after another."""
    remote_timeout_s: float = 30.0
    """With kind=remote, seconds a request may wait to connect and for each read of the answer before it counts as
    timed out (then retried)."""
    remote_retries: int = 3
    """With kind=remote, times a request that timed out, lost its connection, got HTTP 5xx, 408 or 429 or an answer
    that is not a scores list of the right length is sent again, after 0.5 s, 1 s, 2 s, ... (at most 8 s); then its
    rows count as failures under on_error. The resends are the <role>/remote_retries metric."""
    on_error: str = "zero"
    """With kind=rule or remote, a call (row) that raises, times out or returns a non-finite number: zero (score 0,
    logged, counted in the <role>/errors, /timeouts and /non_finite metrics) or abort (stop with an error naming the
    function or URL, the row's data source and the cause)."""
    max_failure_fraction: float | None = None
    """With kind=rule or remote and on_error=zero, a step where more than this fraction of the calls (rows) failed stops
    the run, naming the counts (a reward that never works, e.g. rule=auto on a data_source it does not know, or a
    service that is down, would train on zeros); null: stop only when every call of the step failed; 1.0: never."""

    judge_template: str | None = None
    """With kind=generative, the judge's user message as a Python format string over {prompt} (the policy's prompt as
    text), {response} (the response decoded without special tokens; required) and {reference} (the row's
    ground_truth, empty when it has none); rendered with the judge's own chat template. Literal braces are doubled.
    null: spmd_rlhf.config.judge.DEFAULT_JUDGE_TEMPLATE (a 0-10 rating of the response against the prompt and the
    reference, ending with 'Score: N')."""
    judge_score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """With kind=generative, a regular expression with a group: the first group of its last match in the judge's
    output is the score (the default: the last number); an output it does not match counts as unparsed."""
    judge_score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """With kind=generative, [low, high]: a parsed score s becomes (s - low) / (high - low), so the reward is in [0, 1];
    a number outside the range counts as unparsed."""
    judge_fallback_score: float = 0.0
    """With kind=generative, the reward (in normalised units) of a response whose verdict did not parse; such rows are
    counted in <role>/judge_unparsed, and max_failure_fraction applies to them as to failed rule calls."""
    judge_temperature: float = 0.0
    """With kind=generative, the judge's sampling temperature; 0: greedy."""
    judge_top_p: float = 1.0
    """With kind=generative, the judge's nucleus sampling threshold; 1 keeps every token."""
    judge_max_new_tokens: int = 64
    """With kind=generative, the most tokens the judge writes per response (a verdict cut off there is parsed as it
    is)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of(self, "kind", ("rule", "model", "remote", "generative"))
        if self.kind == "generative":
            require(self, "pp", self.pp == 1, "kind=generative generates on tp ranks only; set pp=1")
            require(self, "fsdp_size", self.fsdp_size == 0, "kind=generative keeps a whole replica per DP rank; set 0")
            template_problem = judge_template_problem(self.judge_template_text)
            require(self, "judge_template", template_problem is None, str(template_problem))
            pattern_problem = score_pattern_problem(self.judge_score_pattern)
            require(self, "judge_score_pattern", pattern_problem is None, str(pattern_problem))
            low_high = len(self.judge_score_range) == 2 and self.judge_score_range[0] < self.judge_score_range[1]
            require(self, "judge_score_range", low_high, "must be [low, high] with low < high, e.g. [0, 10]")
            require(self, "judge_temperature", self.judge_temperature >= 0, "must be >= 0 (0: greedy)")
            require(self, "judge_top_p", 0 < self.judge_top_p <= 1, "must be in (0, 1]")
            at_least(self, 1, "judge_max_new_tokens")
            require(self, "judge_fallback_score", math.isfinite(self.judge_fallback_score), "must be a finite number")
        if self.kind == "remote":
            require(self, "url", self.url is not None, "kind=remote needs the reward service's URL")
        else:
            require(self, "url", self.url is None, f"is only used with kind=remote (kind={self.kind}); remove it")
        require(self, "tokenizer_path", self.tokenizer_path != "", "must be a tokenizer directory or null")
        if self.kind not in ("model", "generative"):
            require(
                self,
                "tokenizer_path",
                self.tokenizer_path is None,
                f"is only used with kind=model or generative (kind={self.kind}); remove it",
            )
        valid_url = self.url is None or self.url.startswith(("http://", "https://"))
        require(self, "url", valid_url, "must be an http:// or https:// URL")
        at_least(self, 1, "remote_batch_size")
        at_least(self, 0, "remote_retries")
        require(self, "remote_timeout_s", self.remote_timeout_s > 0, "must be > 0")
        fraction = self.max_failure_fraction
        require(self, "max_failure_fraction", fraction is None or 0.0 <= fraction <= 1.0, "must be null or in [0, 1]")
        require(self, "rule", self.rule != "", "must name a registered function or be auto")
        at_least(self, 0, "num_workers")
        require(self, "timeout_s", self.timeout_s is None or self.timeout_s > 0, "must be > 0 or null")
        one_of(self, "on_error", ("zero", "abort"))

    @property
    def judge_template_text(self) -> str:
        """The judge's template: ``judge_template``, else the default."""
        return DEFAULT_JUDGE_TEMPLATE if self.judge_template is None else self.judge_template
