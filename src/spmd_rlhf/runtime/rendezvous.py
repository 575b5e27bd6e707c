"""One key/value store per launch round, so a round that torchrun restarts never reads the round before it.

torchrun's agents keep one TCP store for the whole job (``MASTER_ADDR:MASTER_PORT``) and every restart round of the
ranks joins it again. ``init_process_group("env://")`` and ``init_rpc("env://")`` write their keys there under names
that do not change between rounds (``default_pg/...``, ``rpc_prefix_0/...``): a rank of a new round can read a peer
address the failed round left behind and fail with "Gloo connectFullMesh failed ... Connection refused".

``round_store`` agrees on a fresh random *round token* among the ranks of this round and returns the job's store
under the prefix ``spmd_rlhf/<token>/``; the process group and RPC of the launch use nothing else. The token cannot
come from ``TORCHELASTIC_RESTART_COUNT`` alone: the agents of a multi-node job count restarts each for itself (a
membership change restarts without counting), so two nodes may disagree. The agreement is a handshake no stale key
can satisfy:

1. rank 0 draws a token and publishes it under ``spmd_rlhf/round``;
2. every other rank draws a nonce, reads the published token and writes its nonce under ``<token>/ack/<rank>``;
3. rank 0 waits for every rank's ack under *its* token and echoes each nonce under ``<token>/go/<rank>``;
4. a rank is in when the echo under the token it read equals its own nonce. A token read from a failed round gets
   an echo (if any) of an older nonce, so the rank reads the published token again until rank 0 of this round has
   replaced it.

Every wait ends at the launch's deadline with an error naming the ranks or the store that did not answer.

Without torchrun's agent (``srun python recipe.py`` with the rank variables set), rank 0 hosts the job's store, and
the store ends with rank 0's process. RPC's graceful shutdown reads the store after its last barrier, so a rank 0
that ended first would take the store from a rank still shutting down ("Connection reset by peer"). ``depart``: every
other rank says it has shut down, and a rank 0 that hosts the store waits for them, at most the shutdown timeout.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

SCHEME = "spmd-rlhf-round"
"""The ``init_method`` scheme that hands RPC this launch's round store (``rpc_init_method``)."""
ROUND_KEY = "spmd_rlhf/round"
_stores: dict[str, dist.Store] = {}


def _hosts_store(rank: int) -> bool:
    """Whether this rank hosts the job's store: rank 0, unless under ``TORCHELASTIC_USE_AGENT_STORE``."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)


def _job_store(*, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The job's TCP store at ``MASTER_ADDR:MASTER_PORT``: the torchrun agent's (every rank a client) under
    ``TORCHELASTIC_USE_AGENT_STORE``, else one that rank 0 hosts."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        return dist.TCPStore(host, port, world_size, is_master=_hosts_store(rank), timeout=timeout, multi_tenant=True)
    except Exception as error:
        raise RuntimeError(
            f"rank {rank} could not reach the job's store at {host}:{port} within {timeout.total_seconds():g} s "
            f"({error}); check MASTER_ADDR/MASTER_PORT (torchrun --rdzv-endpoint) and that the node can reach it"
        ) from error


def _missing(store: dist.Store, keys: list[str]) -> list[str]:
    return [key for key in keys if not store.check([key])]


def _announce(store: dist.Store, world_size: int, deadline: float) -> str:
    """Rank 0: publish a new token, wait for every rank's ack under it, echo each nonce."""
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    token = f"restart{restarts}-{uuid.uuid4().hex[:12]}"
    store.set(ROUND_KEY, token)
    acks = {rank: f"spmd_rlhf/{token}/ack/{rank}" for rank in range(1, world_size)}
    pause = 0.01
    while missing := _missing(store, list(acks.values())):
        if time.monotonic() > deadline:
            ranks = sorted(rank for rank, key in acks.items() if key in missing)
            raise RuntimeError(
                f"ranks {ranks} of {world_size} did not join this launch round ({token}) in time; they did not "
                f"start, or cannot reach the job's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            )
        time.sleep(pause)
        pause = min(0.5, pause * 2)
    for rank, key in acks.items():
        store.set(f"spmd_rlhf/{token}/go/{rank}", store.get(key))
    return token


def _join(store: dist.Store, rank: int, deadline: float) -> str:
    """Any other rank: ack the published token until rank 0 echoes this rank's own nonce under it."""
    nonce = uuid.uuid4().hex.encode()
    acked = None
    pause = 0.01
    while True:
        if store.check([ROUND_KEY]):
            token = store.get(ROUND_KEY).decode()
            if token != acked:
                store.set(f"spmd_rlhf/{token}/ack/{rank}", nonce)
                acked = token
            echo = f"spmd_rlhf/{token}/go/{rank}"
            if store.check([echo]) and store.get(echo) == nonce:
                return token
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: rank 0 of this launch round did not answer on the job's store at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} in time (last token read: {acked}); "
                f"it did not start or failed before joining: see its output"
            )
        time.sleep(pause)
        pause = min(0.5, pause * 2)


def round_store(*, rank: int, world_size: int, timeout: timedelta) -> dist.PrefixStore:
    """This launch round's store: the job's store under ``spmd_rlhf/<token>/`` with a token every rank of this round
    agreed on and no earlier round used. Waits at most ``timeout`` for the other ranks."""
    store = _job_store(rank=rank, world_size=world_size, timeout=timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    token = _announce(store, world_size, deadline) if rank == 0 else _join(store, rank, deadline)
    return dist.PrefixStore(f"spmd_rlhf/{token}", store)  # PrefixStore puts the "/" in


def depart(store: dist.Store, *, rank: int, world_size: int, timeout_s: float) -> list[int]:
    """After this rank's RPC and process group have shut down: any other rank says so under ``left/<rank>``; a rank 0
    that hosts the job's store waits for every other rank's word, at most ``timeout_s``, and returns the ranks it
    did not hear from (ending then would take the store from ranks still shutting down). Under torchrun's agent,
    which keeps the store for the whole job, rank 0 does not wait."""
    if rank != 0:
        store.set(f"left/{rank}", b"1")
        return []
    if not _hosts_store(rank):
        return []
    keys = {peer: f"left/{peer}" for peer in range(1, world_size)}
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while (missing := _missing(store, list(keys.values()))) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(0.2, pause * 2)
    return sorted(peer for peer, key in keys.items() if key in missing)


def rpc_init_method(store: dist.Store, name: str) -> str:
    """An ``init_method`` for ``TensorPipeRpcBackendOptions`` that makes ``init_rpc`` use ``store`` (under the
    prefix ``name/``, on a connection of its own) instead of a store it would make."""
    _stores[name] = dist.PrefixStore(name, store.clone())  # its own connection: init_rpc sets its timeout
    return f"{SCHEME}://{name}"


def _rendezvous_handler(url: str, **kwargs: object) -> Iterator[tuple[dist.Store, int, int]]:
    location, _, query = url.partition("?")
    fields = dict(pair.split("=", 1) for pair in query.split("&") if "=" in pair)
    yield _stores[location.removeprefix(f"{SCHEME}://")], int(fields["rank"]), int(fields["world_size"])
    raise RuntimeError(f"{SCHEME}:// cannot rendezvous again: a launch round joins once")


dist.register_rendezvous_handler(SCHEME, _rendezvous_handler)
