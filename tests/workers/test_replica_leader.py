"""A rollout replica's tensor-parallel ranks agree on host work (``OneReplica.on_replica_leader``): its first rank
computes, every rank gets that result; a replica of one rank computes for itself."""

from __future__ import annotations

import json

from torchrun_helpers import torchrun


def test_the_replica_leader_computes_and_every_rank_gets_its_result(tmp_path):
    finished = torchrun("replica_leader.py", str(tmp_path), nproc=2, timeout=120, forked=True)
    assert finished.returncode == 0, finished.stdout[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [report["shared"] for report in reports] == [{"answer": "from rank 0"}] * 2
    assert [report["alone"] for report in reports] == [{"answer": "from rank 0"}, {"answer": "from rank 1"}]
    assert [report["calls"] for report in reports] == [[0, 0], [1]]  # rank 1 computed only its own
