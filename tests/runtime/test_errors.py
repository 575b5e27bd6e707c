"""The coordinator's failure messages: a rank whose peer died says so, instead of only the backend's words."""

from __future__ import annotations

import pytest

from spmd_rlhf.runtime.errors import WorkerError


@pytest.mark.parametrize(
    "error",
    [
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18840.",
        "RuntimeError: [gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:5090: Connection reset by peer",
        "DistBackendError: NCCL error: remote process exited or there was a network error",
    ],
)
def test_a_peer_lost_mid_collective_is_named_as_such(error):
    message = str(WorkerError(role="rollout", method="generate_sequences", rank=2, error=error, traceback="tb"))
    assert message.startswith("rollout.generate_sequences failed on rank 2: a rank in its collective was lost")
    assert error in message


def test_an_ordinary_error_is_reported_as_raised():
    message = str(WorkerError(role="actor", method="update", rank=1, error="ValueError: bad row 17", traceback="tb"))
    assert message.startswith("actor.update failed on rank 1: ValueError: bad row 17\n")


def test_a_peers_report_gives_way_to_the_coordinators_own_news_of_the_lost_rank(monkeypatch):
    """A rank whose collective lost its peer reports first, often: the coordinator holds that report for
    ``PEER_REPORT_GRACE_S`` and raises the ``RankLostError`` naming the dead rank if one comes meanwhile, else the
    report itself."""
    import threading
    import time

    from spmd_rlhf.runtime import coordinator as coordinator_module
    from spmd_rlhf.runtime.errors import RankLostError

    monkeypatch.setattr(coordinator_module, "PEER_REPORT_GRACE_S", 0.2)

    def bare() -> coordinator_module.Coordinator:
        coordinator = coordinator_module.Coordinator.__new__(coordinator_module.Coordinator)
        coordinator._changed, coordinator.failure, coordinator.on_failure = threading.Condition(), None, None
        return coordinator

    report = WorkerError(
        role="actor", method="update_actor", rank=0, error="RuntimeError: Connection closed by peer", traceback="tb"
    )
    lost = RankLostError(1, "localhost", "no answer to actor.update_actor")
    named = bare()
    named._fail(report)
    assert named.failure is None  # held for the grace period
    named._fail(lost)
    time.sleep(0.4)
    assert named.failure is lost
    alone = bare()
    alone._fail(report)
    time.sleep(0.4)
    assert alone.failure is report
    ordinary = bare()
    ordinary._fail(WorkerError(role="actor", method="update", rank=1, error="ValueError: bad row", traceback="tb"))
    assert ordinary.failure is not None  # raised at once
