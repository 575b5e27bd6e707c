"""Runs the training model's own code on a paged KV cache: one call per engine step, its sampled tokens out.

The runner owns the cache tensors (allocated on demand, dropped by ``free_cache`` so that an actor can give the memory
back to training between generations) and turns the scheduler's sequences into the model inputs of one step: the new
tokens packed in one row, their positions, the cache slots their K/V go to, and each sequence's block table.
Prefill steps run eagerly (``run``: the logits, then ``sampler.sample_on_device``); decode steps run eagerly too, or,
with ``static_decode``, on the fixed-address padded inputs of ``decode_graphs.StaticDecodeStep`` (replayed from CUDA
graphs when ``capture_graphs``, the sampler inside them), which keep one scratch block past the block manager's.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from spmd_rlhf.data.batch import to_device_together
from spmd_rlhf.engine.decode_graphs import StaticDecodeStep, say_once
from spmd_rlhf.engine.routes import RouteRecorder
from spmd_rlhf.engine.sampler import sample_on_device
from spmd_rlhf.engine.sequence import Sequence
from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.paged_kv import PagedKV


def local_kv_heads(model: DecoderLM) -> int:
    """KV heads computed on this rank: ``k_proj``'s local output rows / head_dim (a TP shard has fewer)."""
    weight = next(iter(model.model.layers.values())).self_attn.k_proj.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return local.shape[0] // model.args.head_dim


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        *,
        block_size: int,
        static_decode: bool = False,
        capture_graphs: bool = False,
        record_routes: bool = False,
        attention_tiling: PagedConfig = DEFAULT_PAGED_CONFIG,
        draw_backend: str | None = None,
    ) -> None:
        """``record_routes``: keep each sequence's experts per MoE layer in ``Sequence.routed_experts``
        (``routes.RouteRecorder``; eager steps only). ``attention_tiling``: the Triton decode kernel's, every step's
        (``PagedKV.kernel_tiling``). ``draw_backend``: the static decode step's draw compiled with it
        (``decode_compile.compile_draw``), or None."""
        if model.head != "lm":
            raise ValueError(f"generation needs a model with an LM head, got head={model.head!r}")
        if capture_graphs and not static_decode:
            raise ValueError("capture_graphs records the static decode step: it needs static_decode=True")
        self.model = model
        self.block_size = block_size
        self.attention_tiling, self.draw_backend = attention_tiling, draw_backend
        self.static_decode, self.capture_graphs = static_decode, capture_graphs
        self._scratch_blocks = 1 if static_decode else 0
        """Cache blocks past the block manager's: padding rows of a static decode step write and read one."""
        self._static_step: StaticDecodeStep | None = None
        self._retired_captures = 0
        """Graphs of static decode steps dropped so far (``graphs_ever_captured``)."""
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_kv_heads = local_kv_heads(model)
        """KV heads this rank caches: all of them, or its share when the model is tensor-parallel."""
        self._key_cache: torch.Tensor | None = None
        self._value_cache: torch.Tensor | None = None
        self.ran_static_step = False
        """Whether the latest ``run`` was a decode step on the static decode step."""
        if record_routes and static_decode:
            raise ValueError("recording routes runs decode steps eagerly: it needs static_decode=False")
        self.routes = RouteRecorder(model, block_size=block_size) if record_routes else None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: keys and values of ``block_size`` tokens in every layer."""
        args = self.model.args
        per_token = 2 * args.num_layers * self.num_kv_heads * args.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of the allocated cache the block manager may hand out; 0 when it is not allocated."""
        return 0 if self._key_cache is None else self._key_cache.shape[1] - self._scratch_blocks

    def blocks_for_bytes(self, kv_cache_bytes: int) -> int:
        """How many blocks a budget of ``kv_cache_bytes`` holds (at least one, or an error naming the minimum)."""
        num_blocks = kv_cache_bytes // self.block_bytes - self._scratch_blocks
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} is less than one KV block ({self.block_bytes} bytes for "
                f"{self.block_size} tokens"
                f"{' besides the static decode step scratch block' if self._scratch_blocks else ''}); "
                "give the cache more memory or lower block_size"
            )
        return num_blocks

    def allocate_cache(self, num_blocks: int) -> None:
        """Make sure a cache of at least ``num_blocks`` blocks exists (a larger one already allocated is kept)."""
        if self.num_blocks >= num_blocks:
            return
        self.free_cache()
        args = self.model.args
        shape = (args.num_layers, num_blocks + self._scratch_blocks, self.block_size, self.num_kv_heads, args.head_dim)
        # Zeros, not empty: masked-out cache slots still enter attention's probs @ V as 0 * value, and uninitialised
        # memory can hold NaN.
        self._key_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._value_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.routes is not None:
            self.routes.allocate(shape[1], self.device)

    def read_blocks(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """Copies of the keys and values of cache ``blocks`` (``[layers, len(blocks), block_size, kv heads,
        head_dim]`` each, this rank's heads), for a checkpoint."""
        assert self._key_cache is not None, "allocate_cache before read_blocks"
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return {"keys": self._key_cache.index_select(1, index), "values": self._value_cache.index_select(1, index)}

    def write_blocks(self, blocks: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """Put back what ``read_blocks`` read from ``blocks``."""
        assert self._key_cache is not None, "allocate_cache before write_blocks"
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self._key_cache.index_copy_(1, index, tensors["keys"].to(self.device, self.dtype))
        self._value_cache.index_copy_(1, index, tensors["values"].to(self.device, self.dtype))

    def free_cache(self) -> None:
        """Drop the cache tensors (their memory returns to the allocator; the next ``allocate_cache`` makes new ones),
        and the static decode step and graphs, which hold their addresses."""
        self._key_cache = self._value_cache = None
        if self.routes is not None:
            self.routes.free()
        self._retired_captures = self.graphs_ever_captured
        self._static_step = None

    def prepare_decode(self, *, max_rows: int, max_blocks_per_seq: int) -> None:
        """With ``static_decode``, make sure the static decode step holds ``max_rows`` rows of block tables
        ``max_blocks_per_seq`` wide (an existing one that does is kept, with its graphs); nothing otherwise."""
        assert self._key_cache is not None, "allocate_cache before prepare_decode"
        step = self._static_step
        if not self.static_decode or (
            step is not None and step.max_rows >= max_rows and step.max_blocks_per_seq >= max_blocks_per_seq
        ):
            return
        self._retired_captures = self.graphs_ever_captured
        self._static_step = StaticDecodeStep(
            self.model,
            key_cache=self._key_cache,
            value_cache=self._value_cache,
            scratch_block=self.num_blocks,
            max_rows=max_rows,
            max_blocks_per_seq=max_blocks_per_seq,
            capture=self.capture_graphs,
            attention_tiling=self.attention_tiling,
            draw_backend=self.draw_backend,
        )

    @property
    def graphs_captured(self) -> int:
        """Decode steps captured into CUDA graphs so far, one per batch size and sampling kind (0 without graphs)."""
        return 0 if self._static_step is None else len(self._static_step.graphs)

    @property
    def graphs_ever_captured(self) -> int:
        """CUDA graphs this runner has captured, those of dropped static decode steps included."""
        return self._retired_captures + self.graphs_captured

    @property
    def static_step(self) -> StaticDecodeStep | None:
        """The prepared static decode step (with its buffers and graphs), if any."""
        return self._static_step

    def decodes_on_static_step(self, rows: int, widest: int) -> bool:
        """Whether a decode step of ``rows`` sequences whose block tables are at most ``widest`` blocks runs on the
        static decode step: the only decode step that can take a token still pending on the device as its input."""
        step = self._static_step
        return step is not None and rows <= step.max_rows and widest <= step.max_blocks_per_seq

    def sample_step(
        self, seqs: list[Sequence], *, is_prefill: bool, seeds: list[int], positions: list[int]
    ) -> torch.Tensor:
        """One engine step of ``seqs`` and its draw, row r keyed by ``seeds[r]`` and ``positions[r]``
        (``sampler.sample``): the samples ``[3, rows]`` on the device (``sampler.draw``), their first ``len(seqs)``
        columns the sequences' (a static decode step's bucket may have padding rows after them)."""
        assert self._key_cache is not None, "allocate_cache before sample_step"
        step = self._static_step
        self.ran_static_step = not is_prefill and step is not None and step.fits(seqs)
        if self.ran_static_step:
            return step.run(seqs, seeds=seeds, positions=positions)
        if not is_prefill and step is not None:
            say_once(
                "decode-past-static-step",
                f"a decode step of {len(seqs)} rows with block tables up to "
                f"{max(len(seq.block_table) for seq in seqs)} blocks runs eagerly, without CUDA graphs: the static "
                f"decode step holds {step.max_rows} rows of {step.max_blocks_per_seq} blocks",
                device=self.device,
            )
        logits = self.run(seqs, is_prefill=is_prefill)
        _, samples = sample_on_device(logits, [seq.params for seq in seqs], seeds=seeds, positions=positions)
        return samples

    def run(self, seqs: list[Sequence], *, is_prefill: bool) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` for the token after each sequence's last one, from an eager step.

        A prefill step computes each sequence's tokens from ``num_cached_tokens`` (the rest are shared prefix blocks
        or earlier chunks, already in the cache) up to its ``prefill_end`` (a chunk of a long prompt: its row's logits
        are then dropped); a decode step computes each sequence's last token.
        """
        assert self._key_cache is not None, "allocate_cache before run"
        assert not any(seq.token_pending for seq in seqs), "an eager step reads every input token on the host"
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens_q = [0]
        context_lens = [(seq.prefill_end or len(seq)) if is_prefill else len(seq) for seq in seqs]
        for seq, end in zip(seqs, context_lens):
            start = seq.num_cached_tokens if is_prefill else end - 1
            new_positions = range(start, end)
            token_ids += seq.token_ids[start:end]
            positions += new_positions
            slots += [
                seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in new_positions
            ]
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(new_positions))
        max_blocks = max(len(seq.block_table) for seq in seqs)
        # Inference tensors, as the static decode step's buffers are (what compiled layers guard on), moved in one
        # pinned copy, not six that each wait for the device.
        with torch.inference_mode():
            host = {
                "token_ids": torch.tensor(token_ids, dtype=torch.int64)[None],
                "positions": torch.tensor(positions, dtype=torch.int64)[None],
                "slot_mapping": torch.tensor(slots, dtype=torch.int64),
                "block_tables": torch.tensor(
                    [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs], dtype=torch.int32
                ),
                "context_lens": torch.tensor(context_lens, dtype=torch.int32),
                "cu_seqlens_q": torch.tensor(cu_seqlens_q, dtype=torch.int32),
            }
            moved = to_device_together(host, self.device)
        paged = PagedKV(
            key_cache=self._key_cache,
            value_cache=self._value_cache,
            slot_mapping=moved["slot_mapping"],
            block_tables=moved["block_tables"],
            context_lens=moved["context_lens"],
            cu_seqlens_q=moved["cu_seqlens_q"],
            max_seqlen_q=max(end - start for start, end in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_context_len=max(context_lens),
            kernel_tiling=self.attention_tiling,
        )
        recording = self.routes.recording(paged.slot_mapping) if self.routes is not None else contextlib.nullcontext()
        with torch.inference_mode(), recording:
            hidden = self.model.hidden_states(moved["token_ids"], moved["positions"], paged=paged)
            last = paged.cu_seqlens_q[1:].long() - 1
            logits = self.model.lm_head(hidden[0, last])
        if self.routes is not None:
            self.routes.collect(seqs, is_prefill=is_prefill)
        return logits
