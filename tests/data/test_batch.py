"""Batch operations keep rows aligned across fields and never split a prompt's group of samples."""

from __future__ import annotations

import pytest
import torch

from spmd_rlhf.data.batch import Batch


def _batch(rows: int = 6, group_size: int = 2) -> Batch:
    return Batch(
        {"ids": torch.arange(rows * 3).view(rows, 3), "reward": torch.arange(rows, dtype=torch.float32)},
        {"answer": [f"a{i}" for i in range(rows)]},
        {"step": 7},
        group_size,
    )


def test_fields_must_have_equal_rows_and_whole_groups():
    with pytest.raises(ValueError, match="different row counts"):
        Batch({"ids": torch.zeros(3, 2)}, {"answer": ["x"]})
    with pytest.raises(ValueError, match="do not divide into groups of 2"):
        Batch({"ids": torch.zeros(3, 2)}, group_size=2)


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_split_keeps_groups_whole_and_concat_restores(parts):
    batch = _batch(rows=10, group_size=2)
    shards = batch.split(parts)
    assert len(shards) == parts
    sizes = [len(shard) for shard in shards]
    assert sum(sizes) == 10 and all(size % 2 == 0 for size in sizes) and max(sizes) - min(sizes) <= 2
    for shard in shards:
        assert shard["answer"] == [f"a{int(r)}" for r in shard["reward"]]
    restored = Batch.concat([s for s in shards if len(s)])
    assert torch.equal(restored["ids"], batch["ids"]) and restored["answer"] == batch["answer"]
    assert restored.meta == {"step": 7} and restored.group_size == 2


def test_repeat_makes_groups_of_samples():
    prompts = Batch({"prompt_ids": torch.tensor([[1, 2], [3, 4]])}, {"truth": ["x", "y"]})
    samples = prompts.repeat(3)
    assert samples.group_size == 3 and samples["truth"] == ["x"] * 3 + ["y"] * 3
    assert samples["prompt_ids"][:, 0].tolist() == [1, 1, 1, 3, 3, 3]


def test_union_merges_fields_and_rejects_conflicts():
    batch = _batch()
    merged = batch.union(Batch({"values": torch.ones(6)}, meta={"kl": 0.1}))
    assert set(merged.keys()) == {"ids", "reward", "answer", "values"} and merged.meta == {"step": 7, "kl": 0.1}
    with pytest.raises(ValueError, match="field 'reward' differs"):
        batch.union(Batch({"reward": torch.zeros(6)}))
    with pytest.raises(ValueError, match="group sizes 2 and 3 disagree"):
        batch.union(Batch({"x": torch.zeros(6)}, group_size=3))
    with pytest.raises(ValueError, match="6 rows with one of 2 rows"):
        batch.union(Batch({"x": torch.zeros(2)}))


def test_pad_to_multiple_adds_whole_groups():
    batch = _batch(rows=6, group_size=2)
    padded, added = batch.pad_to_multiple(4)
    assert added == 2 and padded.num_groups == 4
    assert torch.equal(padded["ids"][6:], batch["ids"][:2])
    same, none_added = padded.pad_to_multiple(2)
    assert same is padded and none_added == 0


def test_chunk_rows_and_select():
    batch = _batch(rows=6)
    chunks = batch.chunk_rows(4)
    assert [len(c) for c in chunks] == [4, 2]
    picked = batch.select([5, 0])
    assert picked["answer"] == ["a5", "a0"] and picked["reward"].tolist() == [5.0, 0.0]
    with pytest.raises(ValueError, match="fields"):
        Batch.concat([batch, Batch({"other": torch.zeros(2)})])


def test_slice_is_a_view_of_contiguous_rows():
    batch = _batch(rows=6)
    part = batch.slice(2, 5)
    assert part["answer"] == ["a2", "a3", "a4"] and part["reward"].tolist() == [2.0, 3.0, 4.0]
    assert part["reward"].data_ptr() == batch["reward"][2:].data_ptr()


def test_tensors_moved_together_travel_as_one_buffer_and_come_back_equal():
    """``to_device_together``'s layout (the GPU path only adds pinning and non_blocking): tensors of every dtype,
    odd sizes, 0-dim and empty, each a view of one buffer in its own dtype and shape, equal to what went in."""
    from spmd_rlhf.data.batch import through_one_buffer

    tensors = {
        "ids": torch.arange(7, dtype=torch.int64).view(1, 7),
        "mask": torch.tensor([[True, False, True]]),
        "offsets": torch.tensor([0, 3, 5], dtype=torch.int32),
        "scores": torch.randn(3, 5)[:, 1:4],  # not contiguous
        "half": torch.randn(5, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.int16),
    }
    moved = through_one_buffer(tensors, torch.device("cpu"), pinned=False)
    base = moved["ids"].untyped_storage().data_ptr()
    for name, tensor in tensors.items():
        assert moved[name].dtype == tensor.dtype and moved[name].shape == tensor.shape, name
        assert torch.equal(moved[name], tensor), name
        assert moved[name].untyped_storage().data_ptr() == base, name  # one buffer
        assert moved[name].data_ptr() % 16 == 0 or tensor.numel() == 0, name
