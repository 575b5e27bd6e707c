"""Errors the coordinator raises; each names what failed and where, so a user never has to guess which rank hung."""

from __future__ import annotations

import re

# What a collective backend says on a rank whose peer died mid-collective: gloo ("Connection reset by peer",
# "Connection closed by peer", "Broken pipe") and NCCL ("remote process exited", an aborted communicator).
PEER_LOST = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|remote process exited|communicator was aborted", re.IGNORECASE
)


PEER_REPORT_GRACE_S = 3.0
"""How long a rank's report that a peer vanished mid-collective waits for the coordinator to name the lost rank itself
(its connection to a dead rank drops within about a second): that ``RankLostError`` is the clearer failure; the
report is raised only where none comes."""


class RuntimeFailure(RuntimeError):
    """Base of every failure that ends the job."""


class WorkerError(RuntimeFailure):
    """A role method (or runtime command) raised on a worker rank; carries the remote traceback."""

    def __init__(self, *, role: str, method: str, rank: int, error: str, traceback: str) -> None:
        self.role, self.method, self.rank, self.error, self.remote_traceback = role, method, rank, error, traceback
        self.peer_lost = PEER_LOST.search(error) is not None
        """The backend's words for a peer that vanished mid-collective: a report of another rank's loss."""
        cause = (
            f"a rank in its collective was lost (look for the rank that died first): {error}"
            if self.peer_lost
            else error
        )
        super().__init__(
            f"{role}.{method} failed on rank {rank}: {cause}\n--- traceback on rank {rank} ---\n{traceback.rstrip()}"
        )


class RankLostError(RuntimeFailure):
    """A rank stopped answering (process died, node lost, network cut)."""

    def __init__(self, rank: int, where: str, reason: str) -> None:
        self.rank = rank
        super().__init__(f"rank {rank} ({where}) was lost: {reason}")


class CallTimeout(RuntimeFailure, TimeoutError):
    """A wait on the coordinator ran past its timeout."""
