import random

import pytest

from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.scheduler import Scheduler
from spmd_rlhf.engine.sequence import SamplingParams, Sequence, SequenceStatus


def _scheduler(num_blocks, block_size=2, max_num_seqs=8, max_tokens=64):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens)


def _seq(seq_id, prompt_length, max_new_tokens=4):
    prompt = [100 + seq_id * 10 + i for i in range(prompt_length)]
    return Sequence(seq_id, prompt, SamplingParams(max_new_tokens=max_new_tokens), eos_token_id=None)


def test_prefill_then_decode_until_finished():
    scheduler = _scheduler(num_blocks=16)
    seqs = [_seq(i, 3, max_new_tokens=2) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch, prefill = scheduler.schedule()
    assert prefill and batch == seqs
    assert scheduler.finish_step(batch, [1, 1, 1], [0.0] * 3, [0.0] * 3) == []
    batch, prefill = scheduler.schedule()
    assert not prefill and batch == seqs
    assert scheduler.finish_step(batch, [2, 2, 2], [0.0] * 3, [0.0] * 3) == seqs
    assert not scheduler.has_work() and scheduler.block_manager.num_free_blocks == 16


def test_prefill_respects_token_and_sequence_budgets():
    scheduler = _scheduler(num_blocks=64, max_num_seqs=2, max_tokens=10)
    for i in range(4):
        scheduler.add(_seq(i, 4))
    batch, _ = scheduler.schedule()
    assert [s.seq_id for s in batch] == [0, 1]
    scheduler = _scheduler(num_blocks=64, max_num_seqs=8, max_tokens=10)
    for i in range(4):
        scheduler.add(_seq(i, 4))
    batch, _ = scheduler.schedule()
    # 4 + 4 tokens, and the first 2 of the third prompt's 4 (chunked prefill): no step exceeds 10 tokens.
    assert [(s.seq_id, s.prefill_end) for s in batch] == [(0, 4), (1, 4), (2, 2)]
    assert scheduler.end_prefill(batch) == [0, 1] and [s.seq_id for s in scheduler.waiting] == [2, 3]
    assert (batch[2].num_cached_tokens, batch[2].prefill_end, batch[2].status) == (2, None, SequenceStatus.WAITING)
    scheduler.finish_step(batch[:2], [7, 7], [-0.5] * 2, [-0.5] * 2)
    batch, prefill = scheduler.schedule()  # the rest of the third prompt, then the fourth whole
    assert prefill and [(s.seq_id, s.num_cached_tokens, s.prefill_end) for s in batch] == [(2, 2, 4), (3, 0, 4)]
    assert scheduler.end_prefill(batch) == [0, 1] and not scheduler.waiting


def test_a_prompt_longer_than_the_budget_is_prefilled_alone_in_chunks():
    """Nothing else is prefilled before a chunked prompt's last chunk: its blocks are keyed for prefix sharing before
    they are written."""
    scheduler = _scheduler(num_blocks=64, max_tokens=4)
    long, same = _seq(0, 10), _seq(1, 10)
    same.token_ids = list(long.token_ids)  # the same prompt: it shares the long one's blocks
    for seq in (long, same):
        scheduler.add(seq)
    chunks = []
    while scheduler.waiting:
        batch, prefill = scheduler.schedule()
        assert prefill and sum(s.prefill_end - s.num_cached_tokens for s in batch) <= 4
        chunks.append([(s.seq_id, s.num_cached_tokens, s.prefill_end) for s in batch])
        finished = scheduler.end_prefill(batch)
        ended = [batch[row] for row in finished]
        scheduler.finish_step(ended, [7] * len(ended), [0.0] * len(ended), [0.0] * len(ended))
    # The copy joins the last chunk's step, its every block the long prompt's (written by then, or in that step before
    # any layer reads them); its last token runs again for its logits.
    assert chunks == [[(0, 0, 4)], [(0, 4, 8)], [(0, 8, 10), (1, 9, 10)]]


def test_running_out_of_blocks_preempts_the_newest_and_everything_still_finishes():
    # 3 sequences of 2 prompt tokens each take a block; 4 blocks cannot hold all of them growing to 6 tokens.
    scheduler = _scheduler(num_blocks=4, block_size=2)
    seqs = [_seq(i, 2, max_new_tokens=4) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_work():
        batch, prefill = scheduler.schedule()
        assert batch, "the scheduler must always make progress"
        used = sum(len(s.block_table) for s in scheduler.running)
        assert used <= 4
        scheduler.finish_step(batch, [7] * len(batch), [-0.5] * len(batch), [-0.5] * len(batch))
        steps += 1
        assert steps < 100
    assert scheduler.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED and s.generated_token_ids == [7] * 4 for s in seqs)
    assert scheduler.block_manager.num_free_blocks == 4


def test_random_workloads_never_leak_blocks():
    rng = random.Random(0)
    for trial in range(20):
        scheduler = _scheduler(
            num_blocks=rng.randint(6, 12), block_size=rng.choice([1, 2, 4]), max_num_seqs=rng.randint(1, 6)
        )
        seqs = [_seq(i, rng.randint(1, 4), max_new_tokens=rng.randint(1, 3)) for i in range(rng.randint(1, 8))]
        for seq in seqs:
            scheduler.add(seq)
        for _ in range(500):
            if not scheduler.has_work():
                break
            batch, _ = scheduler.schedule()
            assert batch
            scheduler.finish_step(batch, [rng.randint(1, 50) for _ in batch], [0.0] * len(batch), [0.0] * len(batch))
        assert all(seq.is_finished for seq in seqs), trial
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_a_request_that_can_never_fit_is_refused_up_front():
    scheduler = _scheduler(num_blocks=3, block_size=2)
    scheduler.add(_seq(0, 3, max_new_tokens=4))  # 3 + 4 - 1 = 6 tokens = 3 blocks: fits exactly
    with pytest.raises(ValueError, match="needs up to 4 KV blocks .* the cache has 3"):
        scheduler.add(_seq(1, 4, max_new_tokens=4))
