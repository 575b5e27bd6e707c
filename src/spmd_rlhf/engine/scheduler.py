"""Continuous batching: which sequences run in the next model step, and preemption when KV blocks run out.

Each step is either a prefill of waiting sequences (as many as fit the token and sequence budgets and the free
blocks) or one decode token for every running sequence. A prompt that does not fit what is left of a prefill's token
budget (``max_num_batched_tokens``) is prefilled in chunks (chunked prefill): the step takes what fits, the sequence
keeps its blocks and stays first in the queue, and the next prefill steps go on from there until its last chunk,
which alone samples a token, so no step exceeds the budget however long the prompt. Nothing else is prefilled before
that last chunk (whose step others may join): the blocks of its prompt are keyed for prefix sharing from the start,
and another sequence must not read them before they are written. When a running sequence cannot get a block for its next
token, the most recently started one is preempted: its blocks are freed and it goes back to the front of the waiting
queue, keeping the tokens it has generated; its next prefill recomputes their K/V. Results do not change.
"""

from __future__ import annotations

from collections import deque

from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.sequence import FINISHED, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.cached_prefill_tokens = 0
        """Prompt tokens whose K/V a prefill found in the cache (shared prefix blocks), over this scheduler's steps."""

    def add(self, seq: Sequence) -> None:
        """Queue a request; one that could never fit the whole cache on its own is refused here, not mid-run."""
        manager = self.block_manager
        needed = seq.max_blocks(manager.block_size)
        if needed > manager.num_blocks:
            raise ValueError(
                f"request {seq.seq_id} needs up to {needed} KV blocks ({len(seq)} prompt + {seq.params.max_new_tokens} "
                f"new tokens, {manager.block_size} per block) but the cache has {manager.num_blocks}; "
                f"give the KV cache more memory or lower max_new_tokens / the prompt length"
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        scheduled: list[Sequence] = []
        tokens = 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            budget = self.max_num_batched_tokens - tokens
            # A sequence with blocks is one whose prefill an earlier step began (chunked): it has its blocks.
            if not seq.block_table:
                if budget < 1 or not self.block_manager.try_allocate(seq):
                    break
                self.cached_prefill_tokens += seq.num_cached_tokens
            seq.prefill_end = min(len(seq), seq.num_cached_tokens + budget)
            tokens += seq.prefill_end - seq.num_cached_tokens
            scheduled.append(seq)
            if seq.prefill_chunk:
                break  # the step is full; the sequence stays first in the queue
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
        if scheduled:
            return scheduled, True

        taken = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            if seq.awaits_last_token:
                taken.append(seq)  # ends when its pending token is read: no step, no block for it
                continue
            while not self.block_manager.append_slot(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                scheduled.append(seq)
                taken.append(seq)
        self.running.extendleft(reversed(taken))
        return scheduled, False

    def next_decode(self) -> tuple[int, int] | None:
        """The rows and the widest block table (in blocks) of the next ``schedule`` when it is sure to be a decode
        step without preemption (nothing waits, so no prefill; the blocks for every row's next token are free), else
        None. Sequences whose last token is still pending count it (``Sequence.reserve_token``), so this is known
        before that token is read."""
        if self.waiting:
            return None
        block_size, most = self.block_manager.block_size, self.max_num_seqs
        rows = widest = new_blocks = 0
        for seq in self.running:  # every step at every row: kept to plain arithmetic
            if rows == most:
                break
            if seq.awaits_last_token:
                continue
            blocks = -(-len(seq.token_ids) // block_size)
            rows += 1
            if blocks > widest:
                widest = blocks
            if len(seq.block_table) < blocks:
                new_blocks += 1
        return (rows, widest) if rows and new_blocks <= self.block_manager.num_free_blocks else None

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def end_prefill(self, seqs: list[Sequence]) -> list[int]:
        """After a prefill step of ``seqs``: those that ran a chunk of their prompt now have it cached (the next
        prefill goes on from there); the rows of the others, which sample their next token."""
        rows = []
        for row, seq in enumerate(seqs):
            if seq.prefill_chunk:
                seq.num_cached_tokens = seq.prefill_end
            else:
                rows.append(row)
            seq.prefill_end = None
        return rows

    def finish_step(
        self, seqs: list[Sequence], token_ids: list[int], log_probs: list[float], sampling_log_probs: list[float]
    ) -> list[Sequence]:
        """Append each sequence's new token and its two log-probs (``sample``'s), in place of its pending one if it
        has one; free and return the sequences that finished."""
        finished = []
        for seq, token_id, log_prob, sampling_log_prob in zip(seqs, token_ids, log_probs, sampling_log_probs):
            seq.append(token_id, log_prob, sampling_log_prob)
            if seq.status is FINISHED:
                self.block_manager.deallocate(seq)
                finished.append(seq)
        if finished:
            # One pass, not a deque.remove (O(running)) per finished sequence: O(n^2) when a whole batch ends at once.
            remaining = [seq for seq in self.running if seq.status is not FINISHED]
            self.running.clear()
            self.running.extend(remaining)
        return finished
