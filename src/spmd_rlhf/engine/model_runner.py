"""Runs the training model's own code on a paged KV cache: one call per engine step, last-position logits out.

The runner owns the cache tensors (allocated on demand, dropped by ``free_cache`` so that an actor can give the memory
back to training between generations) and turns the scheduler's sequences into the model inputs of one step: the new
tokens packed in one row, their positions, the cache slots their K/V go to, and each sequence's block table. Decode
steps run eagerly; CUDA graphs for them are not implemented.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.paged_kv import PagedKV

from .sequence import Sequence


def local_kv_heads(model: DecoderLM) -> int:
    """KV heads computed on this rank: ``k_proj``'s local output rows / head_dim (a TP shard has fewer)."""
    weight = next(iter(model.model.layers.values())).self_attn.k_proj.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return local.shape[0] // model.args.head_dim


class ModelRunner:
    def __init__(self, model: DecoderLM, *, block_size: int) -> None:
        if model.head != "lm":
            raise ValueError(f"generation needs a model with an LM head, got head={model.head!r}")
        self.model = model
        self.block_size = block_size
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_kv_heads = local_kv_heads(model)
        """KV heads this rank caches: all of them, or its share when the model is tensor-parallel."""
        self._key_cache: torch.Tensor | None = None
        self._value_cache: torch.Tensor | None = None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: keys and values of ``block_size`` tokens in every layer."""
        args = self.model.args
        per_token = 2 * args.num_layers * self.num_kv_heads * args.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the allocated cache; 0 when it is not allocated."""
        return 0 if self._key_cache is None else self._key_cache.shape[1]

    def blocks_for_bytes(self, kv_cache_bytes: int) -> int:
        """How many blocks a budget of ``kv_cache_bytes`` holds (at least one, or an error naming the minimum)."""
        num_blocks = kv_cache_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} is less than one KV block ({self.block_bytes} bytes for "
                f"{self.block_size} tokens); give the cache more memory or lower block_size"
            )
        return num_blocks

    def allocate_cache(self, num_blocks: int) -> None:
        """Make sure a cache of at least ``num_blocks`` blocks exists (a larger one already allocated is kept)."""
        if self.num_blocks >= num_blocks:
            return
        self.free_cache()
        args = self.model.args
        shape = (args.num_layers, num_blocks, self.block_size, self.num_kv_heads, args.head_dim)
        # Zeros, not empty: masked-out cache slots still enter attention's probs @ V as 0 * value, and uninitialised
        # memory can hold NaN.
        self._key_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._value_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def free_cache(self) -> None:
        """Drop the cache tensors (their memory returns to the allocator; the next ``allocate_cache`` makes new ones)."""
        self._key_cache = self._value_cache = None

    def run(self, seqs: list[Sequence], *, is_prefill: bool) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` for the token after each sequence's last one.

        A prefill step computes each sequence's tokens from ``num_cached_tokens`` on (the rest are shared prefix blocks
        already in the cache); a decode step computes each sequence's last token.
        """
        assert self._key_cache is not None, "allocate_cache before run"
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens_q = [0]
        for seq in seqs:
            start = seq.num_cached_tokens if is_prefill else len(seq) - 1
            new_positions = range(start, len(seq))
            token_ids += seq.token_ids[start:]
            positions += new_positions
            slots += [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in new_positions]
            cu_seqlens_q.append(cu_seqlens_q[-1] + len(new_positions))
        max_blocks = max(len(seq.block_table) for seq in seqs)
        context_lens = [len(seq) for seq in seqs]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        paged = PagedKV(
            key_cache=self._key_cache,
            value_cache=self._value_cache,
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor([seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs], torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            cu_seqlens_q=tensor(cu_seqlens_q, torch.int32),
            max_seqlen_q=max(end - start for start, end in zip(cu_seqlens_q, cu_seqlens_q[1:])),
            max_context_len=max(context_lens),
        )
        with torch.inference_mode():
            hidden = self.model.hidden_states(
                tensor(token_ids, torch.int64)[None], tensor(positions, torch.int64)[None], paged=paged
            )
            last = paged.cu_seqlens_q[1:].long() - 1
            return self.model.lm_head(hidden[0, last])
