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


def test_a_rank_zero_hosting_the_store_waits_for_the_others_to_leave(monkeypatch):
    """Without torchrun's agent rank 0 hosts the job's store: it ends only after the other ranks have shut down (RPC's
    shutdown reads the store after its last barrier), or after the timeout, naming the ranks it did not hear from."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    leaves = [
        threading.Timer(delay_s, rendezvous.depart, args=(store,), kwargs=dict(rank=rank, world_size=3, timeout_s=1))
        for rank, delay_s in ((1, 0.3), (2, 0.5))
    ]
    start = time.monotonic()
    for leave in leaves:
        leave.start()
    assert rendezvous.depart(store, rank=0, world_size=3, timeout_s=5) == []
    assert 0.5 <= time.monotonic() - start < 3
    # A rank that never leaves: rank 0 waits the timeout and names it.
    start = time.monotonic()
    assert rendezvous.depart(dist.PrefixStore("next", store), rank=0, world_size=2, timeout_s=0.3) == [1]
    assert 0.3 <= time.monotonic() - start < 2


def test_under_torchrun_rank_zero_does_not_wait_for_the_others(job_store, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # the agent keeps the store for the whole job
    start = time.monotonic()
    assert rendezvous.depart(job_store, rank=0, world_size=4, timeout_s=5) == []
    assert time.monotonic() - start < 1
