"""What the coordinator hands back: ``RoleHandle`` (call a role's methods), ``CallFuture`` (a pending result) and
``BatchRef`` (a batch that stays on the worker ranks; the coordinator knows only ids, keys, row counts and owners).

Handles reach the coordinator only through ``Dispatcher``, the four operations it offers them, so this module does not
import the coordinator and the coordinator uses nothing of the handles but their public attributes."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime.dispatch import Dispatch, dispatch_mode
from spmd_rlhf.runtime.transfer import Schema, ShardInfo


class Dispatcher(Protocol):
    """What handles ask of the coordinator (``runtime.coordinator.Coordinator`` implements it)."""

    def submit(self, role: RoleRecord, method: str, mode: Dispatch, *args: Any, **kwargs: Any) -> CallFuture:
        """Issue ``role.method(*args, **kwargs)`` under ``mode``; a future at once."""

    def wait(self, futures: dict[int, torch.futures.Future], timeout: float | None, description: str) -> None:
        """Block until every per-rank future is done, a rank fails, or ``timeout`` (None: the call timeout) passes."""

    def release(self, batch_id: int, owners: tuple[int, ...]) -> None:
        """The batch is no longer referenced: its owners may drop it."""

    def fetch(self, ref: BatchRef, *, timeout: float | None = None) -> Batch:
        """Every row of ``ref`` on the coordinator."""


@dataclass(frozen=True)
class RoleRecord:
    name: str
    role_class: type
    dims: ParallelDims
    ranks: tuple[int, ...]

    @property
    def owners(self) -> list[int]:
        return self.dims.result_owners(self.ranks)


class BatchRef:
    """A batch that lives on worker ranks, one DP shard per owner; the coordinator knows only its shape of rows."""

    def __init__(self, coordinator: Dispatcher, batch_id: int, shards: tuple[ShardInfo, ...], schema: Schema) -> None:
        self.id = batch_id
        self.shards = shards
        self.schema = schema
        self._coordinator = coordinator
        weakref.finalize(self, coordinator.release, batch_id, tuple(shard.owner for shard in shards))

    def __len__(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def __repr__(self) -> str:
        rows = ", ".join(f"rank {shard.owner}: {shard.rows}" for shard in self.shards)
        return f"BatchRef(id={self.id}, keys={self.keys()}, rows={{{rows}}})"

    def keys(self) -> list[str]:
        return [*self.schema.tensor_specs, *self.schema.non_tensor_keys]

    @property
    def group_size(self) -> int:
        return self.schema.group_size

    @property
    def meta(self) -> dict[str, Any]:
        return self.schema.meta

    def fetch(self, timeout: float | None = None) -> Batch:
        """Bring every row to the coordinator (counted in ``bytes_received``); only when the loop really needs it."""
        return self._coordinator.fetch(self, timeout=timeout)


class CallFuture:
    """The pending result of one call: per-rank futures plus how to combine their values."""

    def __init__(
        self,
        coordinator: Dispatcher,
        description: str,
        futures: dict[int, torch.futures.Future],
        combine: Callable[[dict[int, Any]], Any],
        *,
        result_owners: list[int] | None = None,
    ) -> None:
        self.description = description
        self.result_owners = result_owners
        """For data-parallel calls: the ranks that will hold the result's DP shards."""
        self._coordinator = coordinator
        self.rank_futures = futures
        """One future per rank of the call."""
        self._combine = combine
        self._lock = threading.Lock()
        self._value: Any = None
        self._combined = False

    def done(self) -> bool:
        return all(future.done() for future in self.rank_futures.values())

    def result(self, timeout: float | None = None) -> Any:
        """Wait (at most ``timeout`` seconds, default the runtime's call timeout) and return the combined value."""
        self._coordinator.wait(self.rank_futures, timeout, self.description)
        return self.resolved()

    def resolved(self) -> Any:
        """The combined value of a future that is ``done()``."""
        with self._lock:
            if not self._combined:
                self._value = self._combine({rank: future.value() for rank, future in self.rank_futures.items()})
                self._combined = True
            return self._value


class RoleHandle:
    """The coordinator's view of a spawned role: ``handle.call("method", ...)`` calls the role's ``method`` under
    its dispatch mode and returns a future at once.

    A typed handle (``spmd_rlhf.controller.role_handles.ActorHandle``) subclasses this with one method per dispatched
    method of its worker, each forwarding to ``call``; ``coordinator.spawn(..., handle=ActorHandle)`` returns one. A
    plain ``RoleHandle`` also takes ``handle.method(...)`` for any method of a worker that has no typed handle."""

    def __init__(self, coordinator: Dispatcher, record: RoleRecord, ready: CallFuture) -> None:
        self._coordinator = coordinator
        self.record = record
        self.ready = ready
        """Completes once the role is built on all its ranks."""

    @property
    def name(self) -> str:
        return self.record.name

    def call(self, method: str, *args: Any, **kwargs: Any) -> CallFuture:
        """Issue ``method(*args, **kwargs)`` on the role's ranks under the method's dispatch mode; a future at once."""
        mode = dispatch_mode(self.record.role_class, method)
        return self._coordinator.submit(self.record, method, mode, *args, **kwargs)

    def __getattr__(self, method: str) -> Callable[..., CallFuture]:
        if method.startswith("_") or type(self) is not RoleHandle:
            # A typed handle names its methods; one it lacks is a mistake, not a remote call.
            raise AttributeError(f"{type(self).__name__} has no method {method!r}")
        return functools.partial(self.call, method)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.record.name!r}, {self.record.dims}, ranks={list(self.record.ranks)})"
