"""What the coordinator hands back: ``RoleHandle`` (call a role's methods), ``CallFuture`` (a pending result) and
``BatchRef`` (a batch that stays on the worker ranks; the coordinator knows only ids, keys, row counts and owners)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..data.batch import Batch
from .dispatch import dispatch_mode
from .layout import ParallelDims
from .transfer import Schema, ShardInfo

if TYPE_CHECKING:
    from .coordinator import Coordinator


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

    def __init__(self, coordinator: Coordinator, batch_id: int, shards: tuple[ShardInfo, ...], schema: Schema) -> None:
        self.id = batch_id
        self.shards = shards
        self.schema = schema
        self._coordinator = coordinator
        weakref.finalize(self, coordinator._release, batch_id, tuple(shard.owner for shard in shards))

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
        coordinator: Coordinator,
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
        self._futures = futures
        self._combine = combine
        self._lock = threading.Lock()
        self._value: Any = None
        self._combined = False

    def done(self) -> bool:
        return all(future.done() for future in self._futures.values())

    def result(self, timeout: float | None = None) -> Any:
        """Wait (at most ``timeout`` seconds, default the runtime's call timeout) and return the combined value."""
        self._coordinator._wait(self._futures, timeout, self.description)
        return self._resolved()

    def _resolved(self) -> Any:
        with self._lock:
            if not self._combined:
                self._value = self._combine({rank: future.value() for rank, future in self._futures.items()})
                self._combined = True
            return self._value



class RoleHandle:
    """The coordinator's view of a spawned role: ``handle.method(...)`` calls ``method`` under its dispatch mode."""

    def __init__(self, coordinator: Coordinator, record: RoleRecord, ready: CallFuture) -> None:
        self._coordinator = coordinator
        self.record = record
        self.ready = ready
        """Completes once the role is built on all its ranks."""

    @property
    def name(self) -> str:
        return self.record.name

    def __getattr__(self, method: str) -> Callable[..., CallFuture]:
        if method.startswith("_"):
            raise AttributeError(method)
        mode = dispatch_mode(self.record.role_class, method)
        return functools.partial(self._coordinator._call, self.record, method, mode)

    def __repr__(self) -> str:
        return f"RoleHandle({self.record.name!r}, {self.record.dims}, ranks={list(self.record.ranks)})"
