import pytest

from spmd_rlhf.engine.block_manager import BlockManager
from spmd_rlhf.engine.sequence import SamplingParams, Sequence, SequenceStatus

PARAMS = SamplingParams(max_new_tokens=8)


def _seq(seq_id, tokens, params=PARAMS):
    return Sequence(seq_id, tokens, params, eos_token_id=0)


def test_samples_of_one_prompt_share_its_full_blocks():
    manager = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    first, second = _seq(0, prompt), _seq(1, prompt)
    assert manager.try_allocate(first)
    assert first.num_cached_tokens == 0 and len(first.block_table) == 3
    assert manager.try_allocate(second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]  # the partial block is each sample's own
    assert second.num_cached_tokens == 8
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert manager.num_free_blocks == 10 - 4
    manager.deallocate(first)
    assert [manager.ref_counts[b] for b in second.block_table] == [1, 1, 1]
    manager.deallocate(second)
    assert manager.num_free_blocks == 10 and not any(manager.ref_counts)


def test_different_prompts_do_not_share_and_freed_keys_are_dropped_on_reuse():
    manager = BlockManager(num_blocks=2, block_size=2)
    a = _seq(0, [1, 2, 3, 4])
    assert manager.try_allocate(a)
    manager.deallocate(a)
    b = _seq(1, [5, 6, 7, 8])
    assert manager.try_allocate(b)
    assert b.num_cached_tokens == 0
    manager.deallocate(b)
    # a's blocks were reused for b, so a gets no stale hit.
    again = _seq(2, [1, 2, 3, 4])
    assert manager.try_allocate(again)
    assert again.num_cached_tokens == 0


def test_a_fully_cached_prompt_still_runs_its_last_token():
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = _seq(0, [1, 2, 3, 4]), _seq(1, [1, 2, 3, 4])
    assert manager.try_allocate(first)
    assert manager.try_allocate(second)
    assert second.block_table == first.block_table and second.num_cached_tokens == 3


def test_allocation_counts_blocks_and_append_needs_a_block_at_boundaries():
    manager = BlockManager(num_blocks=3, block_size=2)
    too_long = _seq(0, [1, 2, 3, 4, 5, 6, 7])
    assert not manager.try_allocate(too_long)
    assert too_long.block_table == [] and manager.num_free_blocks == 3
    seq = _seq(1, [1, 2, 3])
    assert manager.try_allocate(seq)
    assert len(seq.block_table) == 2 and manager.num_free_blocks == 1
    seq.append(9, -0.1, -0.1)  # 4 tokens: still two blocks
    assert manager.append_slot(seq)
    assert len(seq.block_table) == 2
    seq.append(9, -0.1, -0.1)  # 5 tokens: the fifth starts a third block
    assert manager.append_slot(seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 0
    seq.append(9, -0.1, -0.1)
    seq.append(9, -0.1, -0.1)  # 7 tokens: a fourth block is needed and none is free
    assert not manager.append_slot(seq) and len(seq.block_table) == 3


def test_sequence_stops_on_eos_stop_ids_and_length():
    eos = _seq(0, [5])
    eos.append(0, -1.0, -1.0)
    assert eos.status is SequenceStatus.FINISHED and eos.finish_reason == "stop"
    stop = _seq(1, [5], SamplingParams(stop_token_ids=(7,)))
    stop.append(7, -1.0, -1.0)
    assert stop.finish_reason == "stop" and stop.generated_token_ids == [7]
    length = _seq(2, [5], SamplingParams(max_new_tokens=2))
    length.append(3, -1.0, -1.0)
    assert not length.is_finished
    length.append(3, -1.0, -1.0)
    assert length.finish_reason == "length" and length.log_probs == [-1.0, -1.0]


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="empty prompt"):
        _seq(0, [])
