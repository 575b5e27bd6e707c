"""Decode steps replayed from CUDA graphs: the host cost of a step becomes a few input copies and one launch.

An eager decode step at a real depth is about 2,000 operator calls, each 10-20 µs of host time, so batch-1 decode of a
1.5B model ran at 3 % of what memory bandwidth allows on an H100 (``docs/benchmarks.md``, G1). A CUDA graph records
the step's kernels once and replays them with one launch; serving engines (vLLM, SGLang, nano-vllm) all decode this
way. A graph replays fixed addresses with fixed shapes, so ``StaticDecodeStep`` runs the model on fixed-address
input buffers padded to a few batch sizes (``decode_buckets``), one graph each, captured the first time a batch of that
size decodes. A padding row decodes token 0 at position 0 into a scratch KV block that no sequence owns (the runner
keeps one past the block manager's), reading only that block, so it touches nothing real; its output is dropped.

The whole step is captured: the trunk, the LM head and the sampler (``sampler.draw_rows``, which reads every per-row
value from device tensors; compiled with the blocks under ``rollout.compile``: ``decode_compile.compile_draw``),
leaving the sampled ids where the next step gathers its inputs from and the ids with their two log-probs
(``[3, rows]`` float32) in the graph's output, which the host copies back. Each row's sampling
parameters live in a device buffer, rewritten only when the row's sequence (its ``SamplingParams``) changes; its
uniform (``row_uniforms`` of its seed and position) travels with the step's positions in one copy. The work of a
draw depends on the batch's sampling kind (``sampler.GREEDY``, ``SAMPLED``, ``FILTERED``: an argmax, a two-level
search, a sort of the vocabulary), so a graph is captured per batch size and kind, the kind chosen on the host from
the rows' parameters; every ``SamplingParams`` has a kind, so no sampling falls back to eager steps. A filtered
graph sorts each row to find its support, where the eager sampler takes ``topk`` when no row has top-p: the same
floor, so the same tokens. The same class without capture (``capture=False``) runs the identical padded,
fixed-address inputs eagerly; that is how the padding, scratch-block and sampling logic is tested on CPU.

When the graphs apply (``graphs_unsupported`` says why not, once in the log): a CUDA model whose decode attention is the
Triton paged kernel (which reads the context lengths and block tables from device tensors; the flash-attn paged path
takes host integers, and the SDPA fallback gathers shapes that change every step), TP-split modules on local shards
(``models.local_tensor_parallel``: DTensor's dispatch is not capturable; the step's NCCL all-reduces and all-gathers
are, as NCCL and PyTorch's ProcessGroupNCCL document it, every rank of the replica capturing and replaying the same
graphs in the same order, which its agreed schedule gives), and MoE experts on the grouped-GEMM path (the expert loop
reads each layer's per-expert counts on the host). Under TP the graphs hold eager blocks: ``rollout.compile=auto``
does not compile them there (TorchDynamo would trace the collectives), ``on`` does.

A row's input token is gathered inside the graph from the host's ids or from the ids the previous step sampled, still
on the device: the engine's overlapped loop reads those one step late (``llm_engine``).

Holds, besides the model and the cache: the input buffers (``max_rows`` x (11 + ``max_blocks_per_seq``) 8-byte
values and 4 + ``max_blocks_per_seq`` 4-byte ones), one ``[3, rows]`` output per captured graph, and the graphs'
shared memory pool (the intermediates of the largest captured step: its ``[rows, vocab]`` logits and what
``sampler.draw`` holds at peak, 16 bytes per logit when sorting). Graphs share that pool, which is safe because every
replay's output is consumed (copied to the host, on the same stream) before the next replay starts.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from spmd_rlhf.engine.decode_compile import compile_draw
from spmd_rlhf.engine.sampler import GREEDY, draw_rows, row_sampling, row_uniforms
from spmd_rlhf.engine.sequence import SamplingParams, Sequence
from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig
from spmd_rlhf.kernels.triton_support import use_triton
from spmd_rlhf.models.attention import flash_reads_paged, resolve_backend
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.moe import Experts
from spmd_rlhf.models.paged_kv import PagedKV

logger = logging.getLogger(__name__)

DECODE_MODES = ("auto", "off", "static")
"""``auto``: CUDA graphs unless ``graphs_unsupported`` names a reason, else eager steps; ``off``: eager steps;
``static``: the graphs' padded fixed-address inputs run eagerly (no capture), on any device: what the graphs replay,
checkable on CPU."""


def decode_buckets(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 32, then every multiple of 32, up to and including ``max_rows``.
    A batch runs in the smallest bucket that holds it; padding rows cost little while decode is bound by reading
    the weights."""
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows} must be >= 1")
    buckets = [size for size in (1, 2, 4, 8, 16, 32) if size < max_rows]
    buckets += list(range(64, max_rows, 32))
    return [*buckets, max_rows]


def graphs_unsupported(model: DecoderLM, *, block_size: int) -> str | None:
    """Why this model's decode steps cannot be captured, or None when they can (the module docstring says why each
    condition matters)."""
    weight = model.model.embed_tokens.weight
    probe = weight.new_empty(0)
    if any(isinstance(module, Experts) and not module.uses_grouped_mm(probe) for module in model.modules()):
        return (
            "the MoE experts run as a loop over experts here (grouped GEMMs need CUDA bfloat16 on sm90 / sm100), "
            "which reads the per-expert token counts on the host in every layer"
        )
    if not model.local_tensor_parallel and any(isinstance(param, DTensor) for param in model.parameters()):
        return (
            "the model's tensor-parallel modules dispatch through DTensor, which a graph cannot capture "
            "(models.local_tensor_parallel.run_locally puts them on local shards)"
        )
    if weight.device.type != "cuda":
        return f"the model is on {weight.device.type}, not a CUDA device"
    backend = resolve_backend(model.attention_backend, device=weight.device, dtype=weight.dtype)
    if backend == "torch":
        return "decode attention is the pure-torch path (model.attention), whose gathered shapes change every step"
    if flash_reads_paged(backend, block_size):
        return (
            f"flash-attn reads the paged cache at kv block size {block_size}, from host integers each step; "
            "rollout.kv_block_size=16 decodes through the capturable Triton kernel instead"
        )
    if not use_triton(weight.device, "auto"):
        return "the Triton paged decode kernel is not available (Triton missing)"
    return None


_said: set[str] = set()


def say_once(key: str, message: str, *, device: torch.device) -> None:
    """Log ``message`` the first time this process meets ``key``: a warning on CUDA, where graphs were expected,
    else at info level (decode off CUDA is eager by design)."""
    if key in _said:
        return
    _said.add(key)
    logger.log(logging.WARNING if device.type == "cuda" else logging.INFO, message)


class StaticDecodeStep:
    """One decode step of ``model`` over fixed-address inputs padded to a bucket; captured into one CUDA graph per
    bucket when ``capture``. ``scratch_block``: a cache block no sequence owns, written and read by padding rows.
    ``max_blocks_per_seq``: block-table width, enough for the longest request. ``attention_tiling``: the decode
    kernel's (``PagedKV.kernel_tiling``). ``draw_backend``: the TorchDynamo backend the step's draw is compiled with
    (``decode_compile.compile_draw``; the blocks' own, ``compile_backend``), or None for the eager draw."""

    def __init__(
        self,
        model: DecoderLM,
        *,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scratch_block: int,
        max_rows: int,
        max_blocks_per_seq: int,
        capture: bool,
        attention_tiling: PagedConfig = DEFAULT_PAGED_CONFIG,
        draw_backend: str | None = None,
    ) -> None:
        self.model, self.key_cache, self.value_cache = model, key_cache, value_cache
        self.attention_tiling = attention_tiling
        self._draw = draw_rows if draw_backend is None else compile_draw(draw_backend)
        self.block_size = key_cache.shape[2]
        self.scratch_block, self.capture = scratch_block, capture
        self.buckets = decode_buckets(max_rows)
        self.max_blocks_per_seq = max_blocks_per_seq
        device = key_cache.device
        # Positions, cache slots, token sources, the rows' uniforms (float64 bits) and the host's token ids: rows of
        # one buffer, so one copy sends a step's five vectors. Its last row holds the ids the previous step sampled,
        # right after the host's ids, so that one gather picks each row's input from either (``_step``).
        # Inference tensors all (the step runs in inference mode): prefill's positions are, and a compiled rotary
        # table guards on the mode its input was made in.
        with torch.inference_mode():
            self.vectors = torch.zeros(6, max_rows, dtype=torch.int64, device=device)
            self.positions, self.slot_mapping, self.token_sources, _, _, self._sampled = self.vectors
            self.uniforms = self.vectors[3].view(torch.float64)
            self._token_pool = self.vectors[4:].view(-1)
            self._sent_vectors = self.vectors[:5]
            self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
            self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
            self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token per row
            # Each row's temperature, top-k, top-p and greedy flag (``sampler.row_sampling``), as float64.
            self.sampling = torch.zeros(4, max_rows, dtype=torch.float64, device=device)
        # Their host side, pinned on CUDA so the copies are true asynchronous DMA; written through numpy views, which
        # cost no dispatcher call. The block tables are kept: a row is rewritten only when its sequence changes or
        # grows a block (every block_size steps), and sent only when some row was.
        pinned = device.type == "cuda"
        self._host_vectors = torch.zeros(5, max_rows, dtype=torch.int64, pin_memory=pinned)
        self._host_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, pin_memory=pinned)
        self._host_sampling = torch.zeros(4, max_rows, dtype=torch.float64, pin_memory=pinned)
        self._vectors_view, self._tables_view = self._host_vectors.numpy(), self._host_tables.numpy()
        self._uniforms_view = self._vectors_view[3].view(np.float64)
        self._sampling_view = self._host_sampling.numpy()
        self._vocab_size = model.args.vocab_size
        self._row_params: list[SamplingParams | None] = [None] * max_rows
        """The sampling parameters each row holds (padding rows keep whatever they held: their draws are dropped)."""
        self._row_kinds = [GREEDY] * max_rows
        # Every row starts as a greedy one (temperature 1, nothing filtered), so no padding row divides by zero.
        _, *greedy = row_sampling(SamplingParams(temperature=0), self._vocab_size)
        self._sampling_view[:] = np.array(greedy)[:, None]
        self._sampling_stale = True
        self._row_tables: list[list[int] | None] = [None] * max_rows
        """The block-table list each row mirrors (a sequence's list is only appended to; a reset replaces it)."""
        self._row_lengths = [0] * max_rows
        self._padding_table = [scratch_block]
        self._previous_rows: dict[Sequence, int] = {}
        """The row each sequence of the previous step had: where its sampled token sits in the row of sampled ids."""
        self._tables_stale = False
        self._copied = torch.cuda.Event() if pinned else None
        """Recorded after each step's copies: the pinned buffers are not rewritten before the copies have read them."""
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        """Captured steps by (rows, sampling kind)."""
        self.samples: dict[tuple[int, int], torch.Tensor] = {}
        """Each graph's output: ``sampler.draw``'s samples ``[3, rows]``, overwritten by every replay."""
        self._pool = None

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def fits(self, seqs: list[Sequence]) -> bool:
        """Whether this step can run ``seqs`` (few enough rows, block tables narrow enough)."""
        return len(seqs) <= self.max_rows and max(len(seq.block_table) for seq in seqs) <= self.max_blocks_per_seq

    def run(self, seqs: list[Sequence], *, seeds: list[int], positions: list[int]) -> torch.Tensor:
        """A decode step of ``seqs``, row r's draw keyed by ``seeds[r]`` and ``positions[r]`` (``sampler.sample``):
        the samples ``[3, rows]`` (``sampler.draw``) of a bucket of at least ``len(seqs)`` rows, the first
        ``len(seqs)`` of them the sequences'. The sampled ids also stay on the device, as the next step's input for
        every sequence whose last token is then still pending there (``Sequence.token_pending``)."""
        rows = next(size for size in self.buckets if size >= len(seqs))
        with torch.inference_mode():
            kind = self._fill(seqs, rows, seeds=seeds, positions=positions)
            if not self.capture:
                return self._step(rows, kind)
            key = (rows, kind)
            if key not in self.graphs:
                self._capture(key)
            self.graphs[key].replay()
            return self.samples[key]

    def _fill(self, seqs: list[Sequence], rows: int, *, seeds: list[int], positions: list[int]) -> int:
        """Copy the step's inputs into the first ``rows`` entries of the buffers, padding rows after the real ones
        (token 0 at position 0, writing and reading the scratch block), and return the batch's sampling kind. A
        sequence whose last token is pending takes it from the ids the previous step sampled, the others from the
        host."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the pinned buffers (at once when synchronous)
        block_size, count, max_rows = self.block_size, len(seqs), self.max_rows
        vectors = self._vectors_view
        token_positions = [len(seq.token_ids) - 1 for seq in seqs]
        vectors[0, :count] = token_positions
        vectors[1, :count] = [
            seq.block_table[position // block_size] * block_size + position % block_size
            for seq, position in zip(seqs, token_positions)
        ]
        previous = self._previous_rows
        vectors[2, :count] = [max_rows + previous[seq] if seq.token_pending else row for row, seq in enumerate(seqs)]
        vectors[4, :count] = [0 if seq.token_pending else seq.token_ids[-1] for seq in seqs]
        self._previous_rows = {seq: row for row, seq in enumerate(seqs)}
        vectors[0, count:rows] = 0
        vectors[1, count:rows] = self.scratch_block * block_size
        vectors[2, count:rows] = range(count, rows)
        vectors[4, count:rows] = 0
        row_params = self._row_params
        for row, seq in enumerate(seqs):
            table = seq.block_table
            if self._row_tables[row] is not table or self._row_lengths[row] != len(table):
                self._write_row(row, table)
            if row_params[row] is not seq.params:
                self._write_sampling(row, seq.params)
        kind = max(self._row_kinds[:count])
        if kind != GREEDY:
            self._uniforms_view[:count] = row_uniforms(seeds, positions)
        for row in range(count, rows):
            if self._row_tables[row] is not self._padding_table:
                self._write_row(row, self._padding_table)
        # Non-blocking copies, ordered before the replay on the same stream; the host does not wait for queued steps.
        self._sent_vectors.copy_(self._host_vectors, non_blocking=True)  # contiguous, so one DMA (32 B a row)
        if self._tables_stale:
            self.block_tables[:rows].copy_(self._host_tables[:rows], non_blocking=True)
            self._tables_stale = False
        if self._sampling_stale:
            self.sampling.copy_(self._host_sampling, non_blocking=True)  # a few steps a run: every row, one DMA
            self._sampling_stale = False
        if self._copied is not None:
            self._copied.record()
        # Each row sees its tokens up to its own (padding rows: position 0, one key).
        torch.add(self.positions[:rows], 1, out=self.context_lens[:rows])
        return kind

    def _write_sampling(self, row: int, params: SamplingParams) -> None:
        """Put ``params`` in host sampling row ``row`` (sent with the step's copies)."""
        self._row_kinds[row], *values = row_sampling(params, self._vocab_size)
        self._sampling_view[:, row] = values
        self._row_params[row] = params
        self._sampling_stale = True

    def _write_row(self, row: int, table: list[int]) -> None:
        """Mirror ``table`` in host block-table row ``row``: only its new entries when the row already mirrors it."""
        start = self._row_lengths[row] if self._row_tables[row] is table else 0
        self._tables_view[row, start : len(table)] = table[start:]
        if start == 0:
            self._tables_view[row, len(table) :] = 0
        self._row_tables[row], self._row_lengths[row] = table, len(table)
        self._tables_stale = True

    def _trunk(self, rows: int) -> torch.Tensor:
        """The model's trunk on the first ``rows`` entries of the buffers: hidden states ``[rows, hidden]``."""
        paged = PagedKV(
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[:rows],
            context_lens=self.context_lens[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: rows + 1],
            max_seqlen_q=1,
            # An upper bound, fixed like every shape here; kernels that read the cache in place ignore it, and the
            # gather path masks the padded keys (context_lens decides what each row sees).
            max_context_len=self.max_blocks_per_seq * self.block_size,
            kernel_tiling=self.attention_tiling,
        )
        torch.index_select(self._token_pool, 0, self.token_sources[:rows], out=self.input_ids[:rows])
        hidden = self.model.hidden_states(self.input_ids[:rows][None], self.positions[:rows][None], paged=paged)
        return hidden[0]

    def _step(self, rows: int, kind: int) -> torch.Tensor:
        """The whole step on the first ``rows`` entries of the buffers: the trunk, the LM head and a draw of
        sampling ``kind``; the ids go to the row the next step gathers pending tokens from, and the samples
        ``[3, rows]`` are returned."""
        logits = self.model.lm_head(self._trunk(rows))
        token_ids, samples = self._draw(logits, self.sampling, self.uniforms, kind=kind)
        self._sampled[:rows].copy_(token_ids)
        return samples

    def _warm_up(self, key: tuple[int, int]) -> torch.Tensor:
        """Run the step of ``key`` (rows, kind) once as its capture would record it, leaving the previous step's ids
        in place for the replay that follows, and return its samples. The buffers already hold this step's inputs,
        so it writes the same K/V the replay writes."""
        previous = self._sampled.clone()
        samples = self._step(*key)
        self._sampled.copy_(previous)
        return samples

    def _capture(self, key: tuple[int, int]) -> None:
        """Record the step of ``key`` (rows, kind), after a warm-up pass that makes lazy initialisations (cuBLAS
        workspaces, Triton compilation) happen outside the capture."""
        device = self.key_cache.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._warm_up(key)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (the runtime's data plane, say) may use the device meanwhile; only
        # this thread's own unsafe calls during the capture are errors.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.samples[key] = self._step(*key)
        self.graphs[key] = graph
