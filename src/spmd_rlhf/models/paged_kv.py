"""The paged KV cache layout of one generation step, and its pure-torch read and write.

The generation engine keeps every layer's keys and values in fixed-size blocks ``[num_blocks, block_size, kv_heads,
head_dim]``; a sequence's block table lists the blocks holding its tokens in order. One step (a prefill of several
prompts, or one decode token per sequence) packs its new tokens in one row. Each layer first writes the new tokens'
K/V into their slots, then attends over the whole cached context of each sequence. Because the write comes first, a
sequence whose prompt prefix is shared with another one reads that prefix from the cache even when the other
sequence writes it in the same forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig, write_new_tokens


@dataclass(frozen=True)
class PagedKV:
    """Where the packed new tokens of one step write their K/V and which cached keys each of them reads.

    Sequence ``i``'s new tokens are ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of the row; they are the last tokens of
    its context of ``context_lens[i]`` tokens (the earlier ones are already in the cache), so a decode step is the
    case of one new token per sequence.
    """

    key_cache: torch.Tensor
    """``[num_layers, num_blocks, block_size, kv_heads, head_dim]``; a layer uses ``key_cache[layer_index]``."""
    value_cache: torch.Tensor
    """Same shape as ``key_cache``."""
    slot_mapping: torch.Tensor
    """``[num_new_tokens]`` int64: ``block * block_size + offset`` where each new token's K/V is written."""
    block_tables: torch.Tensor
    """``[num_seqs, max_blocks]`` int32, each sequence's blocks in order, padded with 0 (never read: see lengths)."""
    context_lens: torch.Tensor
    """``[num_seqs]`` int32: tokens in each sequence's cache after this step's write."""
    cu_seqlens_q: torch.Tensor
    """``[num_seqs + 1]`` int32 offsets of each sequence's new tokens in the packed row."""
    max_seqlen_q: int
    max_context_len: int
    kernel_tiling: PagedConfig = DEFAULT_PAGED_CONFIG
    """How the Triton decode kernel tiles its walk over the cache (``LLMEngine(attention_tiling=)``)."""

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[2]

    def write(self, layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' ``k, v`` ``[num_new_tokens, kv_heads, head_dim]`` in layer ``layer_index``'s slots."""
        write_new_tokens(self.key_cache[layer_index], self.value_cache[layer_index], k, v, self.slot_mapping)

    @cached_property
    def cu_seqlens_k(self) -> torch.Tensor:
        """``[num_seqs + 1]`` int32 offsets of each sequence's context, for varlen kernels."""
        return torch.nn.functional.pad(self.context_lens.cumsum(0, dtype=torch.int32), (1, 0))

    @cached_property
    def _query_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence, offset within its new tokens) of every packed token, and the allowed-keys mask of the padded
        layout ``[num_seqs, 1, max_seqlen_q, max_context_len]``; the same for every layer, so computed once."""
        device = self.cu_seqlens_q.device
        num_tokens = int(self.slot_mapping.shape[0])
        tokens = torch.arange(num_tokens, device=device)
        sequence = torch.bucketize(tokens, self.cu_seqlens_q[1:], right=True)
        offset = tokens - self.cu_seqlens_q[sequence]
        query_lens = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).long()
        context_lens = self.context_lens.long()
        # Query j of sequence i sits at position context_len - query_len + j and sees keys up to there. Padding
        # queries (j >= query_len) are capped at the last real key so that their softmax stays finite.
        query_positions = context_lens[:, None] - query_lens[:, None] + torch.arange(self.max_seqlen_q, device=device)
        last_key = torch.minimum(query_positions, context_lens[:, None] - 1)
        allowed = torch.arange(self.max_context_len, device=device) <= last_key[:, :, None]
        return sequence, offset, allowed[:, None]

    @cached_property
    def _context_slots(self) -> torch.Tensor:
        """``[num_seqs * max_context_len]`` int64: the cache slot of each sequence's context positions, padded past
        its length with its first slot (masked out by ``allowed``); the same for every layer, so computed once."""
        block_size = self.block_size
        positions = torch.arange(self.max_context_len, device=self.block_tables.device)
        blocks = self.block_tables.long().gather(1, (positions // block_size).expand(len(self.block_tables), -1))
        return (blocks * block_size + positions % block_size).view(-1)

    def gather(
        self, layer_index: int, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded per-sequence ``q [num_seqs, heads, max_q, d]``, cached ``k, v [num_seqs, kv_heads, max_context, d]``
        and the allowed-keys mask, for any dense masked-attention kernel; ``q`` is the packed ``[tokens, heads, d]``.
        The cached keys and values are gathered token by token with one ``index_select`` each (a third of the time
        of indexing whole blocks on CPU)."""
        sequence, offset, allowed = self._query_rows
        padded_q = q.new_zeros(len(self.context_lens), self.max_seqlen_q, *q.shape[1:])
        padded_q[sequence, offset] = q
        k, v = (
            cache[layer_index]
            .flatten(0, 1)
            .index_select(0, self._context_slots)
            .view(len(self.context_lens), self.max_context_len, *cache.shape[3:])
            for cache in (self.key_cache, self.value_cache)
        )
        return padded_q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """The packed ``[tokens, heads, d]`` rows of a padded attention output ``[num_seqs, heads, max_q, d]``."""
        sequence, offset, _ = self._query_rows
        return out.transpose(1, 2)[sequence, offset]
