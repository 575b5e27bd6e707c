"""The generation loop: schedule a step, run the model on the paged cache, sample, repeat until every request ends.

    engine = LLMEngine(model, eos_token_id=tokenizer.eos_token_id, kv_cache_bytes=8 * 1024**3)
    outputs = engine.generate(prompt_token_ids, SamplingParams(temperature=1.0, max_new_tokens=256, seed=1))
    engine.free_cache()  # give the KV memory back to training

Each ``generate`` call starts a fresh block manager: prefix blocks are shared within a call (the n samples of a
prompt, re-prefills after preemption) but not across calls, because the actor's weights change between them and
cached K/V of the old weights would be wrong. Inside ``prefix_cache_session`` (one multi-turn rollout, one set of
weights) the calls share one cache and block manager, so each turn's prompt (the trajectory so far) reuses the K/V
blocks of the turns before it.

Decode steps on CUDA graphs are overlapped with the host (``overlap_host``): the host plans and launches step t + 1
before it reads step t's tokens, one step late (``advance``), with the same results as the synchronous loop.

``start`` and ``advance`` run the same loop in segments, so that the weights may change between them (partial
rollouts, ``partial.py``); ``generate`` is ``start`` then ``advance`` to the end.

With a tensor-parallel model, the block size, cache blocks and batch limits are agreed (the minimum) across the
model's mesh when the engine is built (``agreement.py``), so every rank of a replica runs the same schedule.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from spmd_rlhf.engine.agreement import agree_minimum, schedule_groups
from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.decode_compile import compile_around_attention, compile_backend
from spmd_rlhf.engine.decode_graphs import DECODE_MODES, graphs_unsupported, say_once
from spmd_rlhf.engine.decode_matmul import DEFAULT_TILINGS, apply_decode_matmul
from spmd_rlhf.engine.generation_run import GenerationRun
from spmd_rlhf.engine.model_runner import ModelRunner
from spmd_rlhf.engine.readback import PendingSamples, SampleReadback
from spmd_rlhf.engine.sampler import derive_seed, read_samples
from spmd_rlhf.engine.scheduler import Scheduler
from spmd_rlhf.engine.sequence import FINISHED, SamplingParams, Sequence
from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig
from spmd_rlhf.kernels.skinny_linear import SkinnyConfig
from spmd_rlhf.models.attention import DEFAULT_KV_BLOCK_SIZE, default_kv_block_size, resolve_backend
from spmd_rlhf.models.decoder import DecoderLM


@dataclass
class GenerationStats:
    """Counters of the latest ``generate`` call."""

    preemptions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    """Tokens whose K/V prefill computed; shared prefix blocks are not counted."""
    cached_prefill_tokens: int = 0
    """Prompt tokens prefill skipped because their K/V blocks were already in the cache (shared prefixes)."""
    generated_tokens: int = 0
    max_blocks_in_use: int = 0
    """Peak KV blocks held at once: how big the cache needed to be."""
    cuda_graphs: int = 0
    """Decode graphs (one per batch size and sampling kind) replayed so far by this engine (0: eager decode steps)."""
    cuda_graph_captures: int = 0
    """CUDA graphs captured during this call (0 once every bucket the call needs was captured by an earlier one)."""


_UNLIMITED = 2**62
"""Stands for "size the cache for each call's requests" when budgets are agreed: any fixed budget is smaller."""


class LLMEngine:
    def __init__(
        self,
        model: DecoderLM,
        *,
        eos_token_id: int | None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        seed: int = 0,
        decode_graphs: str = "auto",
        max_model_len: int | None = None,
        record_routes: bool = False,
        overlap_host: bool = True,
        compile_layers: str = "off",
        decode_matmul: str = "auto",
        decode_tiling: SkinnyConfig | Mapping[str, SkinnyConfig] = DEFAULT_TILINGS,
        attention_tiling: PagedConfig = DEFAULT_PAGED_CONFIG,
    ) -> None:
        """``num_blocks`` or ``kv_cache_bytes`` fix the KV cache size (``kv_cache_bytes`` at most what ``max_num_seqs``
        rows of ``max_model_len`` tokens fill, when that is given); with neither, each call gets a cache that holds
        all its requests at full length (no preemption). ``block_size`` None: ``default_kv_block_size`` of the model's
        attention backend (256 where flash-attn reads the cache, else 16). A request without its own seed gets
        ``derive_seed(seed, n)`` for the n-th request this engine has received (counted across ``generate`` calls, so
        repeating a call draws new samples). The cache is allocated on the first ``generate``. ``decode_graphs``: one of
        ``decode_graphs.DECODE_MODES``; ``auto`` replays decode steps from CUDA graphs where they apply (where not, the
        log says why, once). ``max_model_len``: the most tokens of any request (prompt and everything generated); given,
        the static decode step is prepared once for ``max_num_seqs`` rows that long, so the graphs captured in one call
        serve every later call on the same cache (a longer request decodes eagerly); None: prepared for each call's
        requests, and captured again when a call needs more rows or longer rows than any before.

        A tensor-parallel model's ranks must all build their engines together: each of these numbers becomes its
        minimum over the model's mesh (two small all-reduces), so ranks that measured different free memory still
        run one schedule. ``record_routes`` (an MoE model; router replay): each output's ``routed_experts`` holds the
        experts every processed token went to per MoE layer (``routes.py``), and decode steps run eagerly.
        ``overlap_host``: decode steps on the static step (CUDA graphs, or ``static``) read their tokens back one step
        late, so the host plans and launches step t + 1 while the device runs step t (``advance``); the same tokens
        and log-probs as the synchronous loop (False). ``compile_layers``: ``rollout.compile`` (``auto``, ``on`` or
        ``off``): each decoder block compiled around its attention call (``decode_compile.compile_around_attention``),
        and the static step's draw (``compile_draw``); ``auto`` where steps are captured.
        ``decode_matmul``: ``rollout.decode_matmul`` (``torch``; ``triton``: the blocks' projections at batch-1
        steps through ``kernels.skinny_linear``, ``decode_matmul.use_skinny_linear``, where it cannot run the log
        says why, once; ``auto``: triton where it can run, else torch). ``decode_tiling`` (one for every projection,
        or one each: ``decode_matmul.DEFAULT_TILINGS``), ``attention_tiling``: the skinny-linear and paged decode
        kernels' (``benchmarks/gpu_*_sweep.py`` time them)."""
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("give the KV cache size as num_blocks or as kv_cache_bytes, not both")
        if block_size is None:
            weight = model.model.embed_tokens.weight
            block_size = default_kv_block_size(
                resolve_backend(model.attention_backend, device=weight.device, dtype=weight.dtype)
            )
            if decode_graphs == "auto" and graphs_unsupported(model, block_size=DEFAULT_KV_BLOCK_SIZE) is None:
                # flash-attn's paged kernel needs blocks of 256 and reads them from host integers each step, which a
                # graph cannot replay: decode through the capturable Triton kernel on small blocks instead (prefill
                # then gathers the cached blocks).
                block_size = DEFAULT_KV_BLOCK_SIZE
        if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"block_size={block_size}, max_num_seqs={max_num_seqs} and max_num_batched_tokens="
                f"{max_num_batched_tokens} must all be >= 1"
            )
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if decode_graphs not in DECODE_MODES:
            raise ValueError(f"decode_graphs={decode_graphs!r} is unknown; choose one of {', '.join(DECODE_MODES)}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be >= 1 or None")
        groups = schedule_groups(model)
        device = model.model.embed_tokens.weight.device
        self.block_size, self.max_num_seqs, self.max_num_batched_tokens = agree_minimum(
            [block_size, max_num_seqs, max_num_batched_tokens], groups, device
        )
        self.eos_token_id = eos_token_id
        unsupported = graphs_unsupported(model, block_size=self.block_size) if decode_graphs == "auto" else None
        if record_routes:
            unsupported, decode_graphs = "router replay records each step's experts (algorithm.router_replay)", "off"
        if unsupported is not None:
            say_once(unsupported, f"decode steps run eagerly, without CUDA graphs: {unsupported}", device=device)
        capture = decode_graphs == "auto" and unsupported is None
        if (why := apply_decode_matmul(model, decode_matmul, config=decode_tiling)) is not None:
            say_once(why, f"rollout.decode_matmul=triton falls back to F.linear: {why}", device=device)
        backend = compile_backend(compile_layers, graphs=capture)
        if backend is not None:
            compile_around_attention(model, backend=backend)
        self.max_model_len = max_model_len
        self.runner = ModelRunner(
            model,
            block_size=self.block_size,
            static_decode=capture or decode_graphs == "static",
            capture_graphs=capture,
            record_routes=record_routes,
            attention_tiling=attention_tiling,
            draw_backend=backend,
        )
        # Blocks from bytes after the block size is agreed: every rank of the mesh holds an equal shard, so one
        # block costs the same bytes everywhere.
        local_blocks = self.runner.blocks_for_bytes(kv_cache_bytes) if kv_cache_bytes is not None else num_blocks
        if kv_cache_bytes is not None and max_model_len is not None:
            # A budget from free memory can far exceed what the engine can ever fill (max_num_seqs rows at
            # max_model_len tokens); a kept engine would hold the excess through training.
            local_blocks = min(local_blocks, self.max_num_seqs * -(-max_model_len // self.block_size))
        (agreed_blocks,) = agree_minimum([_UNLIMITED if local_blocks is None else local_blocks], groups, device)
        self.fixed_num_blocks = None if agreed_blocks == _UNLIMITED else agreed_blocks
        """Cache size in blocks, or None to size it for each call's requests."""
        self.overlap_host = overlap_host
        self._readback = SampleReadback(device)
        self.seed = seed
        self.num_requests = 0
        """Requests received so far, across calls: numbers the unseeded ones' seeds."""
        self.stats = GenerationStats()
        self._captures_at_start = 0
        self._session: BlockManager | None = None

    @property
    def num_preemptions(self) -> int:
        """Preemptions in the latest ``generate`` call."""
        return self.stats.preemptions

    def free_cache(self) -> None:
        """Release the KV cache memory; the next ``generate`` allocates it again."""
        self.runner.free_cache()

    @contextmanager
    def prefix_cache_session(self, longest_requests: list[int]) -> Iterator[None]:
        """``generate`` calls inside share one KV cache and block manager: a prompt that extends an earlier call's
        prompt and response reuses their K/V blocks. Only while the weights stay the same. ``longest_requests``: the
        most tokens (prompt + everything generated or appended later) each request may reach, which sizes a cache
        without a fixed budget."""
        assert self._session is None, "prefix cache sessions do not nest"
        blocks = sum(-(-length // self.block_size) for length in longest_requests)
        self.runner.allocate_cache(self.fixed_num_blocks or max(blocks, 1))
        self._session = BlockManager(self.runner.num_blocks, self.block_size)
        try:
            yield
        finally:
            self._session = None

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        """Generate a response to every prompt; outputs in input order, with ``generated_token_ids``, ``log_probs``
        (log softmax(logits / T) of each generated token, before top-k / top-p), ``sampling_log_probs`` (under the
        filtered, renormalised distribution it was drawn from) and ``finish_reason`` ("stop" or "length")."""
        run = self.start(prompt_token_ids, params)
        self.advance(run)
        return run.seqs

    def start(
        self, prompt_token_ids: list[list[int]], params: SamplingParams | list[SamplingParams], *, version: int = 0
    ) -> GenerationRun:
        """Queue the requests of a generation that ``advance`` runs, maybe over several segments with weight
        updates between them (``partial.GenerationRun``); ``version``: the policy version of the current weights.
        Outside a prefix cache session the run keeps its KV cache until it ends (one run at a time per engine)."""
        seqs = self._requests(prompt_token_ids, params)
        manager = self._session
        if manager is None and not seqs:
            manager = BlockManager(max(self.runner.num_blocks, 1), self.block_size)  # nothing to run: no cache
        elif manager is None:
            self.runner.allocate_cache(self.fixed_num_blocks or self._blocks_to_finish_at_once(seqs))
            manager = BlockManager(self.runner.num_blocks, self.block_size)
        if seqs and self.max_model_len is not None:
            self.runner.prepare_decode(
                max_rows=self.max_num_seqs, max_blocks_per_seq=-(-self.max_model_len // self.block_size)
            )
        elif seqs:
            self.runner.prepare_decode(
                max_rows=min(self.max_num_seqs, len(seqs)),
                max_blocks_per_seq=max(seq.max_blocks(self.block_size) for seq in seqs),
            )
        scheduler = Scheduler(
            manager, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens
        )
        for seq in seqs:
            scheduler.add(seq)
        seeds = [
            derive_seed(self.seed, self.num_requests + seq.seq_id) if seq.params.seed is None else seq.params.seed
            for seq in seqs
        ]
        self.num_requests += len(seqs)
        self.stats = GenerationStats()
        self._captures_at_start = self.runner.graphs_ever_captured
        return GenerationRun(seqs, seeds, scheduler, version)

    def resume(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        snapshot: dict,
        kv: dict[str, torch.Tensor],
    ) -> GenerationRun:
        """The run that ``start`` made of these requests, as ``GenerationRun.snapshot`` saved it with ``kv``
        (``ModelRunner.read_blocks`` of its ``kv_blocks``): ``advance`` goes on exactly as it would have. The cache
        gets the saved run's number of blocks (a larger one already allocated is kept), so its schedule is the same."""
        self.runner.allocate_cache(snapshot["block_manager"]["num_blocks"])
        run = self.start(prompt_token_ids, params)
        run.restore(snapshot)
        self.runner.write_blocks(run.kv_blocks, kv)
        return run

    def advance(self, run: GenerationRun, *, segment_tokens: int | None = None) -> bool:
        """Run engine steps of ``run`` until every request has ended (``segment_tokens`` None), or until every
        unfinished one has generated at least ``segment_tokens`` more tokens than it had (one segment); True when
        every request has ended. Steps are the same whatever the segments: on unchanged weights a run advanced in
        segments samples exactly what one ``advance`` to the end samples.

        With ``overlap_host``, a decode step on the static decode step is overlapped: its sampled ids stay on the device
        as the next step's input (``StaticDecodeStep.run``), each of its sequences counts a pending token
        (``Sequence.reserve_token``), and its samples are read after the next step is launched. A sequence that ended at
        step t (EOS or a stop token) was already in step t + 1: that row's token is dropped, and its blocks (one more
        for that step at most, never past the request's own ``max_blocks``) are freed with the rest. A sequence whose
        pending token is its last by length takes no further step. The loop waits for the step in flight first (drains)
        before a step that may prefill (a request waits) or preempt (blocks are short), a decode that runs eagerly, and
        the end of a segment; those steps run as the synchronous loop runs them."""
        scheduler, stats = run.scheduler, self.stats
        targets = (
            {} if segment_tokens is None else {seq.seq_id: seq.num_generated + segment_tokens for seq in run.unfinished}
        )

        def segment_done() -> bool:
            return bool(targets) and all(
                seq.num_generated >= targets[seq.seq_id] for seq in (*scheduler.running, *scheduler.waiting)
            )

        in_flight: tuple[list[Sequence], PendingSamples] | None = None
        """The overlapped step launched last and not read yet: its batch and samples."""
        while True:
            if in_flight is not None and not self._can_overlap(scheduler):
                self._finish_step(scheduler, *in_flight)
                in_flight = None
            if not scheduler.has_work() or segment_done():
                break
            manager = scheduler.block_manager
            batch, is_prefill = scheduler.schedule()
            assert batch, "the scheduler made no progress"
            stats.max_blocks_in_use = max(stats.max_blocks_in_use, manager.num_blocks - manager.num_free_blocks)
            if is_prefill:
                stats.prefill_steps += 1
                stats.prefill_tokens += sum(seq.prefill_end - seq.num_cached_tokens for seq in batch)
            else:
                stats.decode_steps += 1
            samples = self.runner.sample_step(
                batch,
                is_prefill=is_prefill,
                seeds=[run.seeds[seq.seq_id] for seq in batch],
                positions=[len(seq.token_ids) - seq.num_prompt_tokens for seq in batch],  # num_generated
            )
            if not (self.overlap_host and self.runner.ran_static_step):
                assert in_flight is None, "a synchronous step follows a drained pipeline"
                rows = scheduler.end_prefill(batch) if is_prefill else None  # a prompt's chunk samples nothing
                self._finish_step(scheduler, batch, read_samples(samples[:, : len(batch)].tolist()), rows=rows)
                continue
            pending = self._readback.start(samples, len(batch))
            if in_flight is not None:
                self._finish_step(scheduler, *in_flight)  # step t, read while step t + 1 runs
            if not segment_done():  # once it is, step t + 1's tokens are past the segment: all dropped
                for seq in batch:
                    if seq.status is not FINISHED:  # a sequence that ended at step t gets none: its row is dropped
                        seq.reserve_token()
            in_flight = (batch, pending)
        if in_flight is not None:
            self._finish_step(scheduler, *in_flight)
        stats.preemptions = run.num_preemptions
        stats.cached_prefill_tokens = scheduler.cached_prefill_tokens
        stats.cuda_graphs = self.runner.graphs_captured
        stats.cuda_graph_captures = self.runner.graphs_ever_captured - self._captures_at_start
        if scheduler.has_work():
            return False
        manager = scheduler.block_manager
        assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
        return True

    def _can_overlap(self, scheduler: Scheduler) -> bool:
        """Whether the next step can be launched before the one in flight is read: a decode on the static step,
        with no prefill or preemption, whatever the tokens in flight turn out to be."""
        shape = scheduler.next_decode()
        return shape is not None and self.runner.decodes_on_static_step(*shape)

    def _finish_step(
        self,
        scheduler: Scheduler,
        batch: list[Sequence],
        samples: PendingSamples | tuple[list[int], list[float], list[float]],
        *,
        rows: list[int] | None = None,
    ) -> None:
        """Append the sampled tokens of a step's sequences and free those that finished: the sequences of ``rows``
        only (None: all). Of an overlapped step (``PendingSamples``), the sequences whose token is pending; the other
        rows are dropped."""
        if isinstance(samples, PendingSamples):
            samples = samples.read()
            rows = [row for row, seq in enumerate(batch) if seq.token_pending]
        token_ids, log_probs, sampling_log_probs = samples
        if rows is not None and len(rows) < len(batch):
            batch = [batch[row] for row in rows]
            token_ids, log_probs = [token_ids[row] for row in rows], [log_probs[row] for row in rows]
            sampling_log_probs = [sampling_log_probs[row] for row in rows]
        scheduler.finish_step(batch, token_ids, log_probs, sampling_log_probs)
        self.stats.generated_tokens += len(batch)

    def _requests(
        self, prompt_token_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError(
                f"{len(params)} SamplingParams for {len(prompt_token_ids)} prompts; give one, or one per prompt"
            )
        vocab_size = self.runner.model.args.vocab_size
        for index, prompt in enumerate(prompt_token_ids):
            if prompt and (min(prompt) < 0 or max(prompt) >= vocab_size):
                raise ValueError(f"prompt {index} has token ids outside the model's vocabulary [0, {vocab_size})")
        return [
            Sequence(index, prompt, request_params, eos_token_id=self.eos_token_id)
            for index, (prompt, request_params) in enumerate(zip(prompt_token_ids, params))
        ]

    def _blocks_to_finish_at_once(self, seqs: list[Sequence]) -> int:
        """Blocks for every request at its longest, ignoring prefix sharing."""
        return sum(seq.max_blocks(self.block_size) for seq in seqs)
