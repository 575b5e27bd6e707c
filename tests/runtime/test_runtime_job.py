"""One 4-rank job (tests/runtime/programs/runtime_suite.py) exercising ordering, overlap, every dispatch mode,
transfers between layouts, coordinator byte counts and the control-plane guards; each test checks one part of it."""

import json

import pytest
from torchrun_helpers import torchrun


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("runtime") / "observations.json"
    finished = torchrun("runtime_suite.py", str(out), nproc=4, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return json.loads(out.read_text())


def test_commands_run_in_issue_order_on_every_rank(job):
    for rank_log in job["order"]:
        assert rank_log == list(range(100))
    # Two colocated roles' all-reduces interleaved 20 times without waiting: each sums value + rank over its DP group
    # (grid: ranks 0 and 2 with rank 0 reporting; flat: ranks 0-3).
    expected = [(2 * index + 2) if index % 2 == 0 else (4 * index + 6) for index in range(20)]
    assert job["all_reduce"] == expected


def test_call_fed_by_a_future_keeps_its_place(job):
    # right.inspect(future of left.slow_make) was issued before right.note(1000): it must run first on right's ranks.
    assert job["deferred_order"] == [-2, 1000]
    assert job["deferred_rows"] == list(range(8))


def test_disjoint_roles_overlap(job):
    assert job["overlap_seconds"] < 1.8  # two 1 s sleeps on disjoint pools; serial would take 2 s


def test_wait_timeout_names_the_call_and_is_not_fatal(job):
    assert "left.sleep did not finish within 0.2 s" in job["timeout_error"]
    assert "[0, 1]" in job["timeout_error"]


def test_one_to_all_all_to_all_rank_zero(job):
    assert job["one_to_all"] == 0
    assert job["all_to_all"] == [[0, 11], [1, 22], [2, 33], [3, 44]]
    assert job["rank_zero"] == 2
    assert job["rank_zero_log"] == [[-2, 1000, -1], [-2, 1000]]


@pytest.mark.parametrize(
    ("role", "owners", "rows", "seen"),
    [
        # dp=2 x tp=2 on ranks 0-3: replicas {0,1} and {2,3}; TP rank 0 keeps the result.
        ("grid", [0, 2], [5, 5], [range(0, 5), range(0, 5), range(5, 10), range(5, 10)]),
        # pp=2 x dp=2: replicas {0,2} and {1,3}; the last stage (ranks 2, 3) keeps the result.
        ("staged", [2, 3], [5, 5], [range(0, 5), range(5, 10), range(0, 5), range(5, 10)]),
        # dp=3 on ranks 1-3: 10 rows split 4/3/3.
        ("trio", [1, 2, 3], [4, 3, 3], [range(0, 4), range(4, 7), range(7, 10)]),
    ],
)
def test_data_parallel_split_replication_and_exact_content(job, role, owners, rows, seen):
    # Produced on flat (dp=4, uneven 3/1/4/2 rows) with tensor, text and dict fields, then re-laid out.
    observed = job[f"dp_{role}"]
    assert observed["owners"] == owners and observed["rows"] == rows
    assert observed["id"] == list(range(10))
    assert observed["payload_ok"]
    assert observed["text"] == [f"row {i}" for i in range(10)]
    assert observed["info"] == [{"id": i, "even": i % 2 == 0} for i in range(10)]
    assert observed["meta"]["step"] == 7
    assert observed["seen_per_rank"] == [list(r) for r in seen]
    expected_seen_by = [owner for owner, count in zip(owners, rows) for _ in range(count)]
    assert observed["seen_by"] == expected_seen_by


def test_non_batch_results_come_back_per_dp_rank(job):
    # Uneven shards (1, 2, 3, 4 rows of ids 0..9) are rebalanced for the next call: 3, 3, 2, 2 rows in order
    # (total = 2 x the sum of the ids a rank received).
    assert job["dp_values"] == [
        {"rows": 3, "total": 6.0},
        {"rows": 3, "total": 24.0},
        {"rows": 2, "total": 26.0},
        {"rows": 2, "total": 34.0},
    ]


def test_every_group_of_a_role_waits_the_collective_timeout(job):
    """trainer.collective_timeout_s bounds a collective on the role-wide group the executor makes as on the mesh's
    (torch's own default for a new gloo group is 30 minutes)."""
    assert job["group_timeouts"] == [600.0, 600.0]


def test_groups_stay_whole_across_layouts(job):
    groups = job["groups"]
    assert groups["id"] == list(range(12)) and groups["group_size"] == 2
    assert groups["dp_rank"] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert groups["meta"] == {"step": 7, "group_size_seen": 2}


def test_colocated_same_layout_moves_nothing(job):
    assert job["colocated_traffic"] == 0


def test_coordinator_batches_enter_through_put(job):
    assert job["put"] == list(range(6))


def test_three_role_chain_bypasses_the_coordinator(job):
    chain = job["chain"]
    assert chain["tensor_bytes"] >= 10 * 2**20
    assert chain["data_plane_bytes"] >= chain["tensor_bytes"]
    assert chain["coordinator_bytes"] < 64 * 1024
    rows = [entry["rows"] for entry in chain["summary"]]
    assert rows == [1024] * 4
    # Every id i appears once with payload 2 * i in each of its 640 columns.
    assert sum(entry["total"] for entry in chain["summary"]) == pytest.approx(2 * 640 * sum(range(4096)))


def test_control_plane_guards(job):
    assert "carries a tensor of shape [100000]" in job["payload_error"]
    assert "data-parallel" in job["payload_error"]
    assert "has no method 'not_a_method'" in job["method_error"]
    assert "choose sizes whose product is 4" in job["spawn_errors"]["too_many"]
    assert "go beyond the 4 ranks" in job["spawn_errors"]["beyond_world"]
    assert "define role classes at module level" in job["spawn_errors"]["local_class"]


def test_released_results_leave_the_workers(job):
    released = job["released"]
    # 10 rounds each stored a 4-shard result on flat2 and a 2-shard one on grid2 (ranks 0 and 2).
    expected = [released["before"][rank] + 10 * (1 + (rank in (0, 2))) for rank in range(4)]
    assert released["during"] == expected
    assert released["after"] == released["before"]
