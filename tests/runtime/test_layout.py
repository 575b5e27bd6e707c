import pytest

from spmd_rlhf.runtime import ParallelDims, ResourcePool


def test_pool_validation():
    assert ResourcePool.range(2, 5).ranks == (2, 3, 4)
    with pytest.raises(ValueError, match="repeat"):
        ResourcePool([0, 1, 1])
    with pytest.raises(ValueError, match="at least one"):
        ResourcePool([])
    assert ResourcePool([0, 1]).overlaps(ResourcePool([1, 2]))
    assert not ResourcePool([0, 1]).overlaps(ResourcePool([2, 3]))


def test_dims_must_cover_the_pool():
    with pytest.raises(ValueError, match=r"role 'actor': pp=1 x dp=2 x tp=3 = 6 ranks, but its pool has 8"):
        ParallelDims(dp=2, tp=3).check_fits(ResourcePool.range(0, 8), role="actor")
    with pytest.raises(ValueError, match="ParallelDims.tp=0"):
        ParallelDims(tp=0)
    ParallelDims(pp=2, dp=2, tp=2).check_fits(ResourcePool.range(0, 8), role="actor")


def test_coordinates_tp_fastest_then_dp_then_pp():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert [(c.pp, c.dp, c.tp) for c in map(dims.coordinates, range(8))] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]


def test_dp_groups_and_result_owners_use_global_ranks():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    ranks = tuple(range(8, 16))
    assert dims.dp_groups(ranks) == [[8, 9, 12, 13], [10, 11, 14, 15]]
    # TP rank 0 of the last pipeline stage keeps each replica's result.
    assert dims.result_owners(ranks) == [12, 14]
    assert ParallelDims(dp=3).result_owners((5, 6, 7)) == [5, 6, 7]
