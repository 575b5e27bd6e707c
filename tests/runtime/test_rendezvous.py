"""The launch round's store: ranks of a new round agree on a fresh token even when the job's store still holds the
keys of a round that failed (torchrun's agents keep one store for every restart round)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from spmd_rlhf.runtime import rendezvous


@pytest.fixture
def job_store(monkeypatch) -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))  # as torchrun's agent hosts it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


def join_round(store: dist.TCPStore, world_size: int, *, rank_zero_delay_s: float = 0.0) -> dict[int, str]:
    """Every rank's token, rank 0 starting ``rank_zero_delay_s`` after the others."""
    tokens: dict[int, str] = {}
    deadline = time.monotonic() + 10

    def rank_zero() -> None:
        time.sleep(rank_zero_delay_s)
        tokens[0] = rendezvous._announce(store, world_size, deadline)

    def other(rank: int) -> None:
        tokens[rank] = rendezvous._join(store, rank, deadline)

    threads = [threading.Thread(target=rank_zero)] + [
        threading.Thread(target=other, args=(rank,)) for rank in range(1, world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return tokens


def test_a_new_round_never_takes_the_failed_rounds_token(job_store):
    first = join_round(job_store, 3)
    assert len(set(first.values())) == 1
    # The next round's ranks 1 and 2 start well before its rank 0: they read the failed round's token first.
    second = join_round(job_store, 3, rank_zero_delay_s=0.5)
    assert len(set(second.values())) == 1, second
    assert second[0] != first[0]


def test_a_round_whose_rank_zero_never_comes_fails_naming_it(job_store):
    job_store.set(rendezvous.ROUND_KEY, "restart0-stale")  # a failed round's token, and no rank 0 to replace it
    with pytest.raises(RuntimeError, match=r"rank 1: rank 0 of this launch round did not answer .* restart0-stale"):
        rendezvous._join(job_store, 1, time.monotonic() + 0.5)


def test_rank_zero_names_the_ranks_that_never_join(job_store):
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] of 3 did not join this launch round"):
        rendezvous._announce(job_store, 3, time.monotonic() + 0.5)


def test_round_store_scopes_every_key_to_the_round(job_store, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # a client of the job's store, as under torchrun
    scoped = rendezvous.round_store(rank=0, world_size=1, timeout=timedelta(seconds=5))
    scoped.set("pg/key", "value")
    token = job_store.get(rendezvous.ROUND_KEY).decode()
    assert job_store.get(f"spmd_rlhf/{token}/pg/key") == b"value"
