"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, a free list, prefix sharing.

Full blocks made only of prompt tokens are keyed by a hash of (previous block's key, block tokens); a sequence
whose prompt starts with blocks already in the cache shares them (reference count + 1) and prefill skips those
tokens. The n samples of one prompt thus hold one copy of the prompt's full blocks. When a sequence lets its blocks
go, its full blocks of generated tokens whose K/V were computed are keyed the same way: a later request whose prompt
is that sequence's tokens plus more (the next turn of a multi-turn trajectory) shares them too. Pure Python, no
tensors.
"""

from __future__ import annotations

from spmd_rlhf.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a KV cache needs at least one block of at least one token (got {num_blocks} x {block_size})"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        """Free blocks in release order (a dict as an ordered set); the oldest is reused first."""
        self._key_of_block: dict[int, int] = {}
        self._block_of_key: dict[int, int] = {}

    def state(self) -> dict:
        """Everything this manager holds (JSON-able); ``from_state`` makes it again."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "ref_counts": self.ref_counts,
            "free": list(self._free),
            "keys": list(self._key_of_block.items()),
        }

    @classmethod
    def from_state(cls, state: dict) -> BlockManager:
        manager = cls(state["num_blocks"], state["block_size"])
        manager.ref_counts = list(state["ref_counts"])
        manager._free = dict.fromkeys(state["free"])
        manager._key_of_block = dict(state["keys"])
        manager._block_of_key = {key: block for block, key in state["keys"]}
        return manager

    def blocks_with_kv(self) -> list[int]:
        """Blocks whose K/V may still be read: held, or free and keyed (a prefix may hit them)."""
        return [block for block in range(self.num_blocks) if self.ref_counts[block] or block in self._key_of_block]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def _block_keys(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Keys of the full blocks among ``seq``'s first ``num_tokens`` tokens: each hashes its tokens and, through
        the previous key, every token before it (a block's K/V depend on the whole prefix)."""
        keys, previous = [], 0
        for index in range(num_tokens // self.block_size):
            previous = hash((previous, tuple(seq.block_tokens(index, self.block_size))))
            keys.append(previous)
        return keys

    def _cached_prefix(self, keys: list[int]) -> list[int]:
        blocks = []
        for key in keys:
            block = self._block_of_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def try_allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` blocks for all its tokens, sharing cached prompt blocks; False (nothing taken) if they don't
        fit."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        keys = self._block_keys(seq, seq.num_prompt_tokens)
        cached = self._cached_prefix(keys)
        # A cached block nobody holds sits in the free list: sharing it takes it from there too.
        reused_from_free = sum(1 for block in cached if self.ref_counts[block] == 0)
        if seq.num_blocks(self.block_size) - len(cached) > self.num_free_blocks - reused_from_free:
            return False
        for block in cached:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.num_cached_tokens = len(cached) * self.block_size
        for index in range(len(cached), seq.num_blocks(self.block_size)):
            block = self._take_free()
            seq.block_table.append(block)
            if index < len(keys) and keys[index] not in self._block_of_key:
                self._key_of_block[block] = keys[index]
                self._block_of_key[keys[index]] = block
        if seq.num_cached_tokens == len(seq):
            # Every token is cached, but the last one must still run to give logits for the next token.
            seq.num_cached_tokens -= 1
        return True

    def _take_free(self) -> int:
        block = next(iter(self._free))
        del self._free[block]
        key = self._key_of_block.pop(block, None)
        if key is not None:
            del self._block_of_key[key]
        self.ref_counts[block] = 1
        return block

    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go back to the free list (keeping their prefix key, so a
        re-run of the same prompt, or a prompt that extends this sequence, can still hit them until they are
        reused)."""
        self._key_computed_blocks(seq)
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
            if self.ref_counts[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _key_computed_blocks(self, seq: Sequence) -> None:
        """Key ``seq``'s full blocks whose every token's K/V is in the cache: all its tokens but the last sampled one,
        whose K/V no step has written yet. A block already keyed, or whose key another block holds, stays as it is."""
        keys = self._block_keys(seq, len(seq) - 1)
        for block, key in zip(seq.block_table, keys):
            if block not in self._key_of_block and key not in self._block_of_key:
                self._key_of_block[block] = key
                self._block_of_key[key] = block

    def append_slot(self, seq: Sequence) -> bool:
        """Make room for the next decode step of ``seq`` (its last token's K/V): a new block when that token starts
        one. False, changing nothing, when it needs a block and none is free. Once per running sequence and decode
        step, so written without the helpers (at 256 rows their calls were a fifth of the host's step)."""
        if len(seq.block_table) * self.block_size >= len(seq.token_ids):
            return True
        if not self._free:
            return False
        seq.block_table.append(self._take_free())
        return True
