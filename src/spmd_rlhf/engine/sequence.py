"""One generation request: its tokens, sampling settings, KV block table and state. Pure Python, no tensors."""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


FINISHED = SequenceStatus.FINISHED
"""A module constant for the loops that test every row every step (an enum member's lookup costs more)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    max_new_tokens: int = 64
    stop_token_ids: Collection[int] = frozenset()
    """Besides EOS, tokens that end the response (kept in it, like EOS); held as a frozenset, so that checking each
    new token costs the same for a handful of ids or thousands."""
    seed: int | None = None
    """Per-request seed (taken modulo 2^64): the same request samples the same tokens whatever else is in the batch;
    None: one derived from the engine's seed and the request's number."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))  # a frozenset is kept as it is
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


PENDING_TOKEN = -1
"""Stands in a sequence's tokens for the one its last decode step sampled while the host has not read it yet
(``Sequence.reserve_token``); never a vocabulary id, never a model input."""


class Sequence:
    def __init__(
        self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, *, eos_token_id: int | None
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id} has an empty prompt")
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        """KV blocks in order. Only appended to; every reset (preemption, a new allocation, a restore) assigns a new
        list, which is how the static decode step tells a grown table from a replaced one."""
        self.num_cached_tokens = 0
        """Leading tokens whose K/V are already in the cache (shared prefix blocks, or chunks of its prefill that
        earlier steps computed); prefill computes the rest."""
        self.prefill_end: int | None = None
        """Set by the scheduler for a prefill step: the token this step's prefill computes up to (exclusive). Short of
        ``len(self)`` when the step's token budget takes only a chunk of the prompt (chunked prefill): the step then
        samples nothing for it, and the next prefill goes on from there."""
        self.log_probs: list[float] = []
        """Each generated token's log-prob under softmax(logits / T), before top-k / top-p (what training computes)."""
        self.sampling_log_probs: list[float] = []
        """Each generated token's log-prob under the top-k / top-p distribution it was drawn from (``sampler``)."""
        self.routed_experts: list[torch.Tensor] = []
        """With router replay recording (``routes.RouteRecorder``): the experts each processed token was routed to, as
        ``[tokens, moe_layers, k]`` host pieces in token order (the last generated token is never processed)."""
        self.finish_reason: str | None = None
        self.token_pending = False
        """The last entry of ``token_ids`` is ``PENDING_TOKEN``: sampled on the device, not read back yet."""
        self.awaits_last_token = False
        """The pending token is the last one this request may generate: it ends by length once that token is read."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prefill_chunk(self) -> bool:
        """Whether the step this sequence is scheduled in computes only a chunk of its prefill (no token sampled)."""
        return self.prefill_end is not None and self.prefill_end < len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return -(-len(self.token_ids) // block_size)

    def max_blocks(self, block_size: int) -> int:
        """Blocks this request holds at its longest (the last sampled token's K/V is never written, hence the - 1)."""
        return -(-(len(self.token_ids) + self.params.max_new_tokens - 1) // block_size)

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size : (index + 1) * block_size]

    def reserve_token(self) -> None:
        """Count the token a launched decode step is sampling for this sequence before the host reads it (the
        overlapped loop, ``llm_engine``): the next step's position, cache slot and block come from the length."""
        assert not self.token_pending, f"sequence {self.seq_id} has a pending token already"
        token_ids = self.token_ids
        token_ids.append(PENDING_TOKEN)
        self.token_pending = True
        self.awaits_last_token = len(token_ids) - self.num_prompt_tokens >= self.params.max_new_tokens

    def append(self, token_id: int, log_prob: float, sampling_log_prob: float) -> None:
        """Add a sampled token with its two log-probs (in place of the pending one, if reserved); finishes the
        sequence on EOS, a stop token or the length limit."""
        if self.token_pending:
            self.token_ids[-1] = token_id
            self.token_pending = self.awaits_last_token = False
        else:
            self.token_ids.append(token_id)
        self.log_probs.append(log_prob)
        self.sampling_log_probs.append(sampling_log_prob)
        if token_id == self.eos_token_id or token_id in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) - self.num_prompt_tokens >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = SequenceStatus.FINISHED
