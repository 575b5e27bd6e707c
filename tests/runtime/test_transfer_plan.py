"""The data-plane planner (pure): who sends which rows to whom, for re-layouts between roles."""

from spmd_rlhf.runtime.transfer import Piece, Schema, ShardInfo, plan_exchanges

SCHEMA = Schema({"x": ("float32", (3,))}, ("text",), 1, {})


def _plan(shards, consumers, schema=SCHEMA):
    return plan_exchanges(batch_id=7, shards=shards, schema=schema, consumers=consumers, transfer_id=1)


def test_same_layout_on_the_same_ranks_moves_nothing():
    plan = _plan([ShardInfo(0, 4), ShardInfo(1, 4)], [[0], [1]])
    assert plan[0].pieces == [Piece(0, 0, 4)] and plan[1].pieces == [Piece(1, 0, 4)]
    assert plan[0].sends == [] and plan[1].sends == []


def test_uneven_shards_are_rebalanced_on_the_same_ranks():
    # Rows selected in place (3 and 5) go back to 4 and 4: rank 1 sends its first row to rank 0.
    plan = _plan([ShardInfo(0, 3), ShardInfo(1, 5)], [[0], [1]])
    assert plan[0].pieces == [Piece(0, 0, 3), Piece(1, 0, 1)] and plan[1].pieces == [Piece(1, 1, 5)]
    assert plan[0].sends == [] and plan[1].sends == [(0, 0, 1)]


def test_uneven_shards_are_rebalanced_when_dp_sizes_differ():
    # 3 + 1 + 4 + 2 = 10 rows onto 3 consumer replicas: 4 / 3 / 3.
    shards = [ShardInfo(0, 3), ShardInfo(1, 1), ShardInfo(2, 4), ShardInfo(3, 2)]
    plan = _plan(shards, [[4], [5], [6]])
    assert plan[4].pieces == [Piece(0, 0, 3), Piece(1, 0, 1)]
    assert plan[5].pieces == [Piece(2, 0, 3)]
    assert plan[6].pieces == [Piece(2, 3, 4), Piece(3, 0, 2)]
    assert plan[2].sends == [(5, 0, 3), (6, 3, 4)]
    assert plan[0].pieces is None  # a sender that consumes nothing


def test_tp_replicas_each_receive_their_replica_rows():
    plan = _plan([ShardInfo(0, 4)], [[0, 1], [2, 3]])
    assert plan[0].pieces == plan[1].pieces == [Piece(0, 0, 2)]
    assert plan[2].pieces == plan[3].pieces == [Piece(0, 2, 4)]
    assert plan[0].sends == [(1, 0, 2), (2, 2, 4), (3, 2, 4)]


def test_groups_are_never_split():
    grouped = Schema({"x": ("float32", ())}, (), 4, {})
    plan = _plan([ShardInfo(0, 12)], [[1], [2]], grouped)
    assert plan[1].pieces == [Piece(0, 0, 8)] and plan[2].pieces == [Piece(0, 8, 12)]


def test_more_replicas_than_rows_gives_empty_inputs():
    plan = _plan([ShardInfo(0, 1)], [[1], [2]])
    assert plan[1].pieces == [Piece(0, 0, 1)] and plan[2].pieces == []
