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
