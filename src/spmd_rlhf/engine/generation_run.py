"""Partial rollouts: a ``generate`` call held between segments, so that a weight update can land mid-generation.

``LLMEngine.start`` makes a ``GenerationRun`` (the requests, their scheduler and block manager, their seeds);
``LLMEngine.advance`` runs it one segment (until every unfinished request has generated ``segment_tokens`` more
tokens) or to the end. Between segments the model's weights may change; ``update_weights`` then tells the run the new
policy version and what to do with the requests in flight (``IN_FLIGHT``):

- ``keep_kv``: go on from the K/V computed under the old weights (as PipelineRL's in-flight weight updates do);
- ``recompute_kv``: drop every request's K/V; the next prefill recomputes prompt and response so far under the new
  weights (the tokens and their log-probs stay, as the old policy sampled them): AReaL's interruptible generation;
- ``drop``: restart every unfinished request from its prompt under the new weights (its seed makes the restart draw
  the same random numbers), so no response mixes versions.

Each generated token is tagged with the version of the weights that sampled it (``token_versions``). A checkpoint
keeps a run in flight as its ``snapshot`` (requests, scheduler queues, block manager) and the K/V of its
``kv_blocks``; ``restore`` makes the same run again, so a resumed run goes on exactly as the one that saved it, in
every mode. Pure Python, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.scheduler import Scheduler
from spmd_rlhf.engine.sequence import Sequence, SequenceStatus

IN_FLIGHT = ("keep_kv", "recompute_kv", "drop")
"""What a weight update does to the requests in flight (module docstring)."""


@dataclass
class GenerationRun:
    """The requests of one ``LLMEngine.start`` call and the state that carries them across segments."""

    seqs: list[Sequence]
    """Every request, in input order (``seq_id`` is the index)."""
    seeds: list[int]
    """Each request's sampling seed."""
    scheduler: Scheduler
    version: int
    """The policy version of the weights generating now."""
    version_starts: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per request, (tokens generated before, version) at each version change it saw unfinished: its tokens from the
    first count on were sampled by that version."""
    preemptions: int = 0
    """Preemptions of the schedulers this run had before its latest requeue (at a weight update)."""

    def __post_init__(self) -> None:
        if not self.version_starts:
            self.version_starts = [[(0, self.version)] for _ in self.seqs]

    @property
    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.seqs if not seq.is_finished]

    @property
    def num_preemptions(self) -> int:
        return self.preemptions + self.scheduler.num_preemptions

    def token_versions(self, seq: Sequence) -> list[int]:
        """The policy version of each token ``seq`` generated."""
        versions: list[int] = []
        starts = self.version_starts[seq.seq_id]
        for (start, version), (end, _) in zip(starts, [*starts[1:], (seq.num_generated, None)]):
            versions += [version] * (end - start)
        return versions

    def update_weights(self, version: int, in_flight: str) -> None:
        """The model now holds policy ``version``; ``in_flight`` (one of ``IN_FLIGHT``) says what becomes of the
        unfinished requests."""
        if in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight={in_flight!r} is unknown; choose one of {', '.join(IN_FLIGHT)}")
        if in_flight != "keep_kv":
            self._requeue(restart=in_flight == "drop")
        self.version = version
        for seq in self.unfinished:
            starts = self.version_starts[seq.seq_id]
            if starts[-1][0] == seq.num_generated:
                starts.pop()  # no token came from the version before
            starts.append((seq.num_generated, version))

    def _requeue(self, *, restart: bool) -> None:
        """Free every request's K/V (and forget every cached prefix: they were computed by other weights) and queue
        the unfinished requests in request order on a fresh block manager; ``restart``: from their prompts."""
        old = self.scheduler
        self.preemptions += old.num_preemptions
        manager = BlockManager(old.block_manager.num_blocks, old.block_manager.block_size)
        self.scheduler = Scheduler(
            manager, max_num_seqs=old.max_num_seqs, max_num_batched_tokens=old.max_num_batched_tokens
        )
        for seq in self.unfinished:
            seq.status = SequenceStatus.WAITING
            seq.block_table, seq.num_cached_tokens = [], 0
            if restart:
                del seq.token_ids[seq.num_prompt_tokens :]
                seq.log_probs.clear()
                seq.sampling_log_probs.clear()
                self.version_starts[seq.seq_id] = [(0, self.version)]
            self.scheduler.add(seq)

    def snapshot(self) -> dict:
        """This run as it stands between segments (JSON-able; floats round-trip exactly): each request's tokens, their
        two log-probs, finish reason, version starts and blocks, the scheduler's queues and the block manager. With
        the K/V of ``kv_blocks`` (the model runner's ``read_blocks``), ``restore`` makes the same run again."""
        scheduler = self.scheduler
        return {
            "version": self.version,
            "preemptions": self.preemptions,
            "scheduler_preemptions": scheduler.num_preemptions,
            "waiting": [seq.seq_id for seq in scheduler.waiting],
            "running": [seq.seq_id for seq in scheduler.running],
            "block_manager": scheduler.block_manager.state(),
            "requests": [
                {
                    "tokens": seq.generated_token_ids,
                    "log_probs": seq.log_probs,
                    "sampling_log_probs": seq.sampling_log_probs,
                    "finish_reason": seq.finish_reason,
                    "status": seq.status.value,
                    "block_table": seq.block_table,
                    "num_cached_tokens": seq.num_cached_tokens,
                    "version_starts": starts,
                }
                for seq, starts in zip(self.seqs, self.version_starts)
            ],
        }

    @property
    def kv_blocks(self) -> list[int]:
        """The cache blocks whose K/V this run may still read: those held, and free ones a prefix may hit again."""
        return self.scheduler.block_manager.blocks_with_kv()

    def restore(self, snapshot: dict) -> None:
        """Take back what ``snapshot`` saved into this run, made by ``LLMEngine.start`` with the same requests
        (``LLMEngine.resume`` does both, and writes the K/V of ``kv_blocks`` back into the cache)."""
        saved = snapshot["requests"]
        if len(saved) != len(self.seqs):
            raise ValueError(f"the saved generation has {len(saved)} requests, this one {len(self.seqs)}")
        self.scheduler.block_manager = BlockManager.from_state(snapshot["block_manager"])
        for seq, request in zip(self.seqs, saved):
            seq.token_ids[seq.num_prompt_tokens :] = request["tokens"]
            seq.log_probs = list(request["log_probs"])
            seq.sampling_log_probs = list(request["sampling_log_probs"])
            seq.finish_reason = request["finish_reason"]
            seq.status = SequenceStatus(request["status"])
            seq.block_table, seq.num_cached_tokens = list(request["block_table"]), request["num_cached_tokens"]
            self.version_starts[seq.seq_id] = [tuple(start) for start in request["version_starts"]]
        self.scheduler.waiting.clear()
        self.scheduler.waiting.extend(self.seqs[index] for index in snapshot["waiting"])
        self.scheduler.running.extend(self.seqs[index] for index in snapshot["running"])
        self.scheduler.num_preemptions = snapshot["scheduler_preemptions"]
        self.version, self.preemptions = snapshot["version"], snapshot["preemptions"]
