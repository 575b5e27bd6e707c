"""The per-rank executor: commands run one at a time, strictly in the order the coordinator issued them.

RPC handler threads only ``submit``; they run concurrently and deliver out of order, so every command carries a
per-rank sequence number and the single executor thread runs number ``n`` only after ``n - 1``. Without this two
collectives could start in different orders on two ranks and deadlock.

The executor also holds this rank's role instances (colocated roles share the process) and its batch store (the DP
shards of results that stay where they were computed, keyed by batch id).
"""

from __future__ import annotations

import pickle
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime.device import bind_thread
from spmd_rlhf.runtime.payload import dumps
from spmd_rlhf.runtime.transfer import Exchange, Schema, run_exchanges
from spmd_rlhf.runtime.worker import RoleContext


@dataclass
class Spawn:
    """Build the role's mesh and any extra process groups its class declares (every rank takes part: group creation
    is collective over the world) and, on the role's ranks, its instance."""

    role: str
    role_class: type
    dims: ParallelDims
    ranks: tuple[int, ...]
    arguments: bytes
    """Pickled ``(args, kwargs)`` for the constructor."""


@dataclass(frozen=True)
class InputSlot:
    """Stands in a call's arguments for the batch assembled by ``Call.inputs[index]``."""

    index: int


@dataclass
class Call:
    role: str
    method: str
    arguments: bytes
    """Pickled ``(args, kwargs)``, with ``InputSlot`` where a batch goes; shared by every rank of the call."""
    inputs: list[Exchange] = field(default_factory=list)
    output_id: int | None = None
    """Data-parallel calls: the id a ``Batch`` result is stored under."""
    keeps_output: bool = False
    """Whether this rank keeps the result (TP rank 0 of the last PP stage of its replica)."""
    per_rank_index: int | None = None
    """All-to-all calls: which entry of each argument list is this rank's."""


@dataclass
class Exchanges:
    """This rank's part of transfers it takes part in without calling a method (senders, and the fetching rank)."""

    exchanges: list[Exchange]


@dataclass
class Put:
    """Store a coordinator-made batch on rank 0 (local only: never crosses RPC)."""

    batch_id: int
    batch: Batch


@dataclass
class Stop:
    pass


@dataclass
class Envelope:
    seq: int
    command: Spawn | Call | Exchanges | Put | Stop
    free: list[int] = field(default_factory=list)
    """Stored batches no longer referenced by the coordinator; dropped before the command runs."""


@dataclass(frozen=True)
class Stored:
    """Report of a data-parallel ``Batch`` result kept on its owner."""

    rows: int
    schema: Schema


@dataclass(frozen=True)
class RemoteFailure:
    role: str
    method: str
    rank: int
    error: str
    traceback: str


class Executor:
    def __init__(
        self,
        rank: int,
        device: torch.device,
        *,
        poll_seconds: float = 0.5,
        collective_timeout: timedelta | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        self.collective_timeout = collective_timeout
        """How long a collective on the groups this executor makes may wait (``trainer.collective_timeout_s``; None:
        torch's module default, 30 min on gloo and 10 on NCCL, which ``launch.bound_new_groups`` also sets to it for
        the groups a ``DeviceMesh`` makes)."""
        self.roles: dict[str, Any] = {}
        self.declared_groups: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
        """Groups roles declared, by (name, ranks): two roles declaring the same one (the actor and the rollout
        both declare ``weight_sync``) share one group, so a collective issued by each side meets on it."""
        self.store: dict[int, Batch] = {}
        self.stopped = threading.Event()
        self._poll_seconds = poll_seconds
        self._condition = threading.Condition()
        self._queue: dict[int, tuple[Envelope | bytes, torch.futures.Future, bool]] = {}
        self._next_seq = 0
        self._thread = threading.Thread(target=self._loop, name=f"spmd-executor-rank{rank}", daemon=True)
        self._thread.start()

    def submit(self, seq: int, envelope: Envelope | bytes, *, local: bool) -> torch.futures.Future:
        """Queue command ``seq``; the future completes with its result (raw when ``local``, else pickled bytes)."""
        future: torch.futures.Future = torch.futures.Future()
        with self._condition:
            if seq < self._next_seq or seq in self._queue:
                raise RuntimeError(f"rank {self.rank}: command number {seq} was delivered twice")
            self._queue[seq] = (envelope, future, local)
            self._condition.notify()
        return future

    def _loop(self) -> None:
        # All role code runs on this thread; CUDA's current device is per thread, so it binds itself first.
        bind_thread(self.device)
        while not self.stopped.is_set():
            with self._condition:
                if not self._condition.wait_for(lambda: self._next_seq in self._queue, timeout=self._poll_seconds):
                    continue
                envelope, future, local = self._queue.pop(self._next_seq)
                self._next_seq += 1
            # Nothing a command does may end this thread: the rank would keep answering heartbeats while its
            # queue never moved, and the job would wait out its full timeout before naming the wrong cause.
            command: Any = None
            try:
                if isinstance(envelope, bytes):
                    envelope = self._decode(envelope)
                if isinstance(envelope, Envelope):
                    command = envelope.command
                    outcome = self._run(envelope)
                else:
                    outcome = envelope
            except BaseException as error:
                outcome = _failure(command, self.rank, error)
            if not local:
                try:
                    outcome = dumps(outcome, what="the result")
                except Exception as error:
                    outcome = dumps(_failure(command, self.rank, error), what="a failure report")
            future.set_result(outcome)
            if isinstance(command, Stop):
                self.stopped.set()

    def _decode(self, payload: bytes) -> Envelope | RemoteFailure:
        """The envelope, or a failure naming this rank and why it could not be read (a class or module that only
        the coordinator's rank can import, or another version of a package on this node)."""
        try:
            return pickle.loads(payload)
        except BaseException as error:
            cause = f"{type(error).__name__}: {error}"
            return RemoteFailure(
                "runtime",
                "decode",
                self.rank,
                f"could not decode the command from the coordinator ({cause}); every node must import "
                f"the same code: install the same packages and versions, and put role classes in modules every "
                f"rank can import",
                traceback.format_exc(),
            )

    def _run(self, envelope: Envelope) -> Any:
        for batch_id in envelope.free:
            self.store.pop(batch_id, None)
        command = envelope.command
        try:
            if isinstance(command, Call):
                return self._call(command)
            if isinstance(command, Spawn):
                return self._spawn(command)
            if isinstance(command, Exchanges):
                return run_exchanges(command.exchanges, rank=self.rank, store=self.store, device=self.device)
            if isinstance(command, Put):
                self.store[command.batch_id] = command.batch
            return None
        except BaseException as error:
            return _failure(command, self.rank, error)

    def _spawn(self, command: Spawn) -> None:
        mesh = command.dims.build_mesh(command.ranks, self.device.type)
        expert_mesh = command.dims.build_expert_mesh(mesh)
        hybrid_shard_mesh = command.dims.build_hybrid_shard_mesh(mesh)
        args, kwargs = pickle.loads(command.arguments)
        # Every role gets a group over all its ranks (checkpoints, role-wide reductions).
        groups = {"role": dist.new_group(sorted(command.ranks), timeout=self.collective_timeout)}
        context_group = command.dims.build_context_group(mesh)
        if context_group is not None:
            groups["cp"] = context_group
        declare = getattr(command.role_class, "process_groups", None)
        for name, partition in (declare(command.dims, command.ranks, *args, **kwargs) if declare else {}).items():
            for ranks in partition:
                key = (name, tuple(sorted(ranks)))
                if key not in self.declared_groups:  # every rank runs the same spawns, so all agree on reuse
                    self.declared_groups[key] = dist.new_group(list(key[1]), timeout=self.collective_timeout)
                group = self.declared_groups[key]
                if self.rank in ranks:
                    groups[name] = group
        if self.rank not in command.ranks:
            return None
        context = RoleContext(
            command.role,
            command.dims,
            command.ranks,
            self.rank,
            mesh,
            self.device,
            groups,
            expert_mesh,
            hybrid_shard_mesh,
        )
        self.roles[command.role] = command.role_class(context, *args, **kwargs)
        return None

    def _call(self, command: Call) -> Any:
        args, kwargs = pickle.loads(command.arguments)
        if command.inputs:
            batches = run_exchanges(command.inputs, rank=self.rank, store=self.store, device=self.device)
            args = [batches[a.index] if isinstance(a, InputSlot) else a for a in args]
            kwargs = {k: batches[v.index] if isinstance(v, InputSlot) else v for k, v in kwargs.items()}
        if command.per_rank_index is not None:
            args = [value[command.per_rank_index] for value in args]
            kwargs = {name: value[command.per_rank_index] for name, value in kwargs.items()}
        result = getattr(self.roles[command.role], command.method)(*args, **kwargs)
        if command.output_id is None:
            return result
        if not command.keeps_output:
            return None
        if isinstance(result, Batch):
            self.store[command.output_id] = result
            return Stored(len(result), Schema.of(result))
        return result


def _failure(command: Any, rank: int, error: BaseException) -> RemoteFailure:
    role = getattr(command, "role", "runtime")
    method = getattr(command, "method", type(command).__name__.lower())
    return RemoteFailure(role, method, rank, f"{type(error).__name__}: {error}", traceback.format_exc())
