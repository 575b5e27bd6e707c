"""``rollout``: sampling, the generation engine, and the rollout role of asynchronous RL."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_rlhf.config.choices import (
    COMPILE_SETTINGS,
    DECODE_MATMULS,
    ENVIRONMENTS,
    PARTIAL_ROLLOUTS,
)
from spmd_rlhf.config.errors import at_least, one_of, require


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
    """Tokens per paged KV-cache block; null: 16, or 256 where generation runs flash-attn (CUDA, a 16-bit model.dtype
    and flash-attn installed: its paged kernel needs a multiple of 256) and decode steps are not captured into CUDA
    graphs (with graphs, decode reads 16-token blocks through the capturable Triton kernel, prefill gathers them)."""
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
    compile: str = "auto"
    """torch.compile each decoder block of the generation copy around its attention call (the norms, projections,
    rotation, residuals and MLP fused by Inductor; the paged attention eager between them), once for every layer,
    decode bucket and prefill length: auto (where decode steps replay from CUDA graphs), on (CPU too: needs a C++
    compiler) or off. On an H100 (session 38) auto took batch-1 decode of the 1.5B shape from 29 % to 45 % of the HBM
    floor with the same tokens; the compile runs once per engine (``rollout.keep_engine``)."""
    decode_matmul: str = "auto"
    """The generation copy's projections (q/k/v, o, gate/up, down) at batch-1 decode steps: torch (F.linear: cuBLAS
    on CUDA), triton (spmd_rlhf.kernels.skinny_linear, which spreads a small matrix-vector product over every
    multiprocessor; CUDA with triton, on one rank or a TP replica's local shards; more rows and prefill stay
    F.linear; in dense blocks the residual adds, norms and SwiGLU's activation run inside the projections' kernels
    too: four kernels per block where seven were; where it cannot run, one log line says why) or auto (triton where
    it can run, else torch, silently). On an H200 (session 48, the 1.5B shape) triton took batch-1 decode from 42.5 %
    to 47.7 % of the HBM floor; larger batches run the same F.linear pieces as torch."""
    overlap_host: bool = True
    """Read each graphed decode step's tokens back one step late (pinned copy and event), so the host plans and
    launches step t + 1 while the device runs step t; the same tokens and log-probs as false (a synchronous read after
    every step). Only decode steps on CUDA graphs overlap; prefill, preemption and eager steps stay synchronous."""
    keep_engine: bool = True
    """Keep each generating role's engine for the run: the actor's generation-layout copy of the weights (rewritten in
    place by every reshard), the KV cache and the CUDA graphs captured on them stay allocated between generations, so
    graphs are captured once per run, not once per step. Costs the actor that copy and the KV cache during training: a
    cache sized from free memory is therefore no larger than the first generation's rows (at most max_num_seqs) fill
    at full length, the dry run counts both on the actor's ranks, and placement=auto turns the key off when the kept
    engine fits beside training in no mapping; false: built for each generation and dropped after it."""
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
    recompute_log_probs: bool | None = None
    """Recompute the rollouts' log-probs with a training forward pass; false uses the engine's, which are the same
    numbers (same model code; equal within 1e-6 in float32) and saves that pass. null: true exactly when
    algorithm.max_staleness >= 1 (its correction needs the log-probs under the current policy)."""
    enabled: bool | None = None
    """Generate on a rollout role of its own (generation-only replicas on their own ranks, fed the actor's weights
    by a mesh-to-mesh sync) instead of on the actor's devices; needs placement split, standalone or manual, and is
    what algorithm.max_staleness > 0 runs on. false: the actor generates (the synchronous HybridEngine path). null:
    true exactly when algorithm.max_staleness >= 1."""
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
    each token tagged with its version: keep_kv (their K/V kept, as PipelineRL does), recompute_kv (their K/V
    recomputed under the new weights, as AReaL's interruptible generation does) or drop (restarted from the prompt:
    no response mixes versions). off: a batch generates whole under the version it was issued with."""
    partial_segment_tokens: int = 8
    """With partial_rollouts: tokens each unfinished request generates per segment (the last segment, issued when
    the step that trains on the batch comes, runs to the end)."""

    def __post_init__(self) -> None:
        at_least(self, 1, "n", "max_new_tokens", "tp", "max_num_seqs", "max_turns", "environment_workers")
        one_of(self, "compile", COMPILE_SETTINGS)
        one_of(self, "decode_matmul", DECODE_MATMULS)
        require(
            self,
            "environment",
            self.environment is None or self.environment in ENVIRONMENTS or ".py:" in self.environment,
            f"must be null, {', '.join(ENVIRONMENTS)}, or path/to/file.py:name "
            "(a class or function making an Environment)",
        )
        require(
            self,
            "max_turns",
            self.max_turns == 1 or self.environment is not None,
            "needs rollout.environment (a second turn answers an environment's observation)",
        )
        require(
            self,
            "max_response_tokens",
            self.max_response_tokens is None or self.max_response_tokens >= self.max_new_tokens,
            f"must be null or at least rollout.max_new_tokens={self.max_new_tokens} (one whole turn)",
        )
        require(
            self,
            "max_response_tokens",
            self.max_response_tokens is None or self.environment is not None,
            "needs rollout.environment (single-turn responses are max_new_tokens long)",
        )
        require(self, "stop_token_ids", all(token >= 0 for token in self.stop_token_ids), "must be token ids >= 0")
        require(self, "kv_block_size", self.kv_block_size is None or self.kv_block_size >= 1, "must be >= 1 or null")
        at_least(self, 0, "temperature", "top_k", "kv_cache_blocks")
        require(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        require(self, "memory_fraction", 0 < self.memory_fraction <= 1, "must be in (0, 1]")
        at_least(self, 0, "n_ranks")
        require(self, "pool", self.pool != "", "must be a name or null")
        require(self, "sync_bucket_mb", self.sync_bucket_mb > 0, "must be > 0")
        one_of(self, "partial_rollouts", PARTIAL_ROLLOUTS)
        at_least(self, 1, "partial_segment_tokens")

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
