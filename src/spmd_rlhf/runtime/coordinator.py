"""The single controller: spawns roles, turns method calls into ordered commands, and keeps only handles to data.

Runs on rank 0's main thread (``launch`` builds it). A call returns a ``CallFuture`` at once. A data-parallel call
whose input is a ``BatchRef`` (or the future of one) schedules the transfer as commands on both the producing and the
consuming ranks; the rows go rank to rank on the data plane, never through here. When an input is still a future, the
call's sequence numbers are reserved now and its commands sent when the producer reports its row counts, so later
calls keep their order and the coordinator never blocks on the producer.

Every byte of every control message is counted (``bytes_sent`` / ``bytes_received``).
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime.dispatch import Dispatch
from spmd_rlhf.runtime.errors import PEER_REPORT_GRACE_S, CallTimeout, RankLostError, RuntimeFailure, WorkerError
from spmd_rlhf.runtime.executor import (
    Call,
    Envelope,
    Exchanges,
    Executor,
    InputSlot,
    Put,
    RemoteFailure,
    Spawn,
    Stop,
    Stored,
)
from spmd_rlhf.runtime.handles import BatchRef, CallFuture, RoleHandle, RoleRecord
from spmd_rlhf.runtime.layout import ResourcePool
from spmd_rlhf.runtime.payload import dumps
from spmd_rlhf.runtime.transfer import Schema, ShardInfo, plan_exchanges

Handle = TypeVar("Handle", bound=RoleHandle)

Transport = Callable[[int, int, bytes], torch.futures.Future]
"""Sends (rank, sequence number, pickled envelope) to a remote rank's executor; the future completes with the pickled
outcome."""


class Coordinator:
    def __init__(
        self,
        *,
        world_size: int,
        executor: Executor,
        transport: Transport,
        call_timeout_s: float,
        hosts: dict[int, str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.bytes_sent = 0
        self.bytes_received = 0
        self.hosts = hosts or {}
        self._executor = executor
        self._transport = transport
        self._call_timeout_s = call_timeout_s
        self._next_seq = [0] * world_size
        self._ids = itertools.count(1)
        self._roles: dict[str, RoleRecord] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(threading.RLock())
        self._to_free: dict[int, list[int]] = {}
        self.failure: RuntimeFailure | None = None
        self.on_failure: Callable[[RuntimeFailure], None] | None = None

    # ---- roles -------------------------------------------------------------------------------------------------

    def spawn(
        self,
        role_class: type,
        *args: Any,
        name: str,
        pool: ResourcePool,
        dims: ParallelDims | None = None,
        handle: type[Handle] = RoleHandle,
        **kwargs: Any,
    ) -> Handle:
        """Build ``role_class(context, *args, **kwargs)`` on every rank of ``pool`` with layout ``dims`` (default:
        all data-parallel), and return a ``handle`` to it (a typed handle, or a plain ``RoleHandle``). Roles on the
        same pool share processes; the call returns at once (``handle.ready``)."""
        dims = dims or ParallelDims(dp=len(pool))
        if name in self._roles:
            raise ValueError(f"a role named {name!r} already exists; give each role a unique name")
        if max(pool.ranks) >= self.world_size:
            raise ValueError(
                f"role {name!r}: pool ranks {list(pool.ranks)} go beyond the {self.world_size} ranks of this job; "
                f"launch more processes or use ranks below {self.world_size}"
            )
        dims.check_fits(pool, role=name)
        try:
            pickle.dumps(role_class)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            raise TypeError(
                f"role {name!r}: {role_class.__qualname__} cannot be sent to the workers ({error}); define role "
                f"classes at module level of the script or an importable module"
            ) from error
        record = RoleRecord(name, role_class, dims, pool.ranks)
        self._roles[name] = record
        command = Spawn(name, role_class, dims, pool.ranks, dumps((args, kwargs), what=f"spawn of role {name!r}"))
        ready = CallFuture(self, f"spawn of role {name!r}", self._send_to_all(command), lambda values: None)
        return handle(self, record, ready)

    # ---- calls -------------------------------------------------------------------------------------------------

    def submit(self, role: RoleRecord, method: str, mode: Dispatch, *args: Any, **kwargs: Any) -> CallFuture:
        """Issue ``role.method`` under its dispatch mode (what ``RoleHandle.call`` does); a future at once."""
        self._raise_if_failed()
        description = f"{role.name}.{method}"
        if mode is Dispatch.DATA_PARALLEL:
            return self._call_data_parallel(role, method, description, args, kwargs)
        for value in (*args, *kwargs.values()):
            if isinstance(value, (Batch, BatchRef, CallFuture)):
                raise TypeError(
                    f"{description} is {mode.value}; batches (and futures) go only to @data_parallel methods"
                )
        targets = role.ranks[:1] if mode is Dispatch.RANK_ZERO else role.ranks
        if mode is Dispatch.ALL_TO_ALL:
            for value in (*args, *kwargs.values()):
                if not isinstance(value, (list, tuple)) or len(value) != len(role.ranks):
                    raise TypeError(
                        f"{description} is all_to_all: every argument must be a list with one entry per rank of "
                        f"role {role.name!r} ({len(role.ranks)} entries)"
                    )
        arguments = dumps((args, kwargs), what=f"the arguments of {description}")
        futures = {}
        for rank, seq in self._reserve(targets).items():
            index = role.ranks.index(rank) if mode is Dispatch.ALL_TO_ALL else None
            futures[rank] = self._send(rank, seq, Call(role.name, method, arguments, per_rank_index=index))
        if mode is Dispatch.ALL_TO_ALL:
            return CallFuture(self, description, futures, lambda values: [values[rank] for rank in role.ranks])
        return CallFuture(self, description, futures, lambda values: values[role.ranks[0]])

    def _call_data_parallel(
        self, role: RoleRecord, method: str, description: str, args: tuple, kwargs: dict
    ) -> CallFuture:
        inputs: list[BatchRef | CallFuture] = []

        def slot(value: Any) -> Any:
            if isinstance(value, Batch):
                value = self.put(value)
            if isinstance(value, CallFuture) and value.result_owners is None:
                raise TypeError(f"{description}: only futures of data-parallel calls can be passed as batches")
            if isinstance(value, (BatchRef, CallFuture)):
                inputs.append(value)
                return InputSlot(len(inputs) - 1)
            return value

        args = tuple(slot(value) for value in args)
        kwargs = {name: slot(value) for name, value in kwargs.items()}
        arguments = dumps((args, kwargs), what=f"the arguments of {description}")
        producers = set()
        for value in inputs:
            producers.update(
                [shard.owner for shard in value.shards] if isinstance(value, BatchRef) else value.result_owners
            )
        involved = sorted(set(role.ranks) | producers)
        seqs = self._reserve(involved)
        output_id = next(self._ids)
        owners = role.owners
        transfer_ids = [next(self._ids) for _ in inputs]
        futures = {rank: torch.futures.Future() for rank in involved}

        def send(refs: list[BatchRef]) -> None:
            plans = [
                plan_exchanges(
                    batch_id=ref.id,
                    shards=list(ref.shards),
                    schema=ref.schema,
                    consumers=role.dims.dp_groups(role.ranks),
                    transfer_id=transfer_id,
                )
                for ref, transfer_id in zip(refs, transfer_ids)
            ]
            for rank in involved:
                if rank in role.ranks:
                    command = Call(
                        role.name, method, arguments, [plan[rank] for plan in plans], output_id, rank in owners
                    )
                else:
                    command = Exchanges([plan[rank] for plan in plans if rank in plan])
                _chain(self._send(rank, seqs[rank], command), futures[rank])

        pending = [value for value in inputs if isinstance(value, CallFuture)]
        if not pending:
            send(inputs)
        else:

            def send_when_ready() -> None:
                try:
                    send([value if isinstance(value, BatchRef) else _as_batch_ref(value) for value in inputs])
                except BaseException as error:
                    failure = (
                        error
                        if isinstance(error, RuntimeFailure)
                        else RuntimeFailure(
                            f"{description}: could not plan its input transfer: {type(error).__name__}: {error}"
                        )
                    )
                    self._fail(failure)

            _gather(pending).add_done_callback(lambda _: send_when_ready())

        def combine(values: dict[int, Any]) -> Any:
            kept = [values[rank] for rank in owners]
            if all(isinstance(value, Stored) for value in kept):
                return self._batch_ref(description, output_id, owners, kept)
            return kept

        role_futures = {rank: futures[rank] for rank in role.ranks}
        return CallFuture(self, description, role_futures, combine, result_owners=owners)

    def _batch_ref(self, description: str, batch_id: int, owners: list[int], kept: list[Stored]) -> BatchRef:
        schema = kept[0].schema
        for owner, stored in zip(owners, kept):
            differences = schema.differences(stored.schema)
            if differences:
                raise RuntimeFailure(
                    f"{description}: the Batch results of DP ranks disagree between rank {owners[0]} and rank "
                    f"{owner}: {'; '.join(differences)}. Pad tensor fields to a fixed length and return the same fields"
                )
        return BatchRef(self, batch_id, tuple(ShardInfo(owner, s.rows) for owner, s in zip(owners, kept)), schema)

    # ---- data held by the coordinator ---------------------------------------------------------------------------

    def put(self, batch: Batch) -> BatchRef:
        """Hand a coordinator-made batch (e.g. prompts) to rank 0's store; consumers then pull their rows from rank 0
        over the data plane. Its bytes count as sent by the coordinator."""
        batch_id = next(self._ids)
        seq = self._reserve([0])[0]
        self._send(0, seq, Put(batch_id, batch))
        with self._lock:
            self.bytes_sent += _batch_bytes(batch)
        return BatchRef(self, batch_id, (ShardInfo(0, len(batch)),), Schema.of(batch))

    def fetch(self, ref: BatchRef | CallFuture, *, timeout: float | None = None) -> Batch:
        """All rows of ``ref`` on the coordinator, in DP order (counted in ``bytes_received``)."""
        if isinstance(ref, CallFuture):
            ref = _as_batch_ref(ref, timeout)
        exchanges = plan_exchanges(
            batch_id=ref.id, shards=list(ref.shards), schema=ref.schema, consumers=[[0]], transfer_id=next(self._ids)
        )
        involved = sorted(exchanges)
        futures = {
            rank: self._send(rank, seq, Exchanges([exchanges[rank]])) for rank, seq in self._reserve(involved).items()
        }
        self.wait(futures, timeout, f"fetch of batch {ref.id}")
        (batch,) = futures[0].value()
        remote_rows = sum(shard.rows for shard in ref.shards if shard.owner != 0)
        with self._lock:
            self.bytes_received += _batch_bytes(batch) * remote_rows // max(len(batch), 1)
        return batch

    def release(self, batch_id: int, owners: tuple[int, ...]) -> None:
        """Queue the batch for freeing on its owners (a ``BatchRef`` was garbage-collected)."""
        with self._lock:
            for owner in owners:
                self._to_free.setdefault(owner, []).append(batch_id)

    # ---- sending, waiting, failing ------------------------------------------------------------------------------

    def _reserve(self, ranks: Any) -> dict[int, int]:
        with self._lock:
            seqs = {rank: self._next_seq[rank] for rank in ranks}
            for rank in seqs:
                self._next_seq[rank] += 1
        return seqs

    def _send(self, rank: int, seq: int, command: Any) -> torch.futures.Future:
        """Deliver one command; the returned future holds its decoded outcome and never raises (failures are
        recorded, and every wait re-raises them)."""
        with self._lock:
            free = self._to_free.pop(rank, [])
        envelope = Envelope(seq, command, free)
        what = f"{getattr(command, 'role', 'runtime')}.{getattr(command, 'method', type(command).__name__)}"
        if rank == 0:
            raw = self._executor.submit(seq, envelope, local=True)
            decode = None
        else:
            payload = dumps(envelope, what=f"the command for {what} to rank {rank}")
            with self._lock:
                self.bytes_sent += len(payload)
            raw = self._transport(rank, seq, payload)
            decode = self._decode
        outcome: torch.futures.Future = torch.futures.Future()

        def done(future: torch.futures.Future) -> None:
            try:
                value = future.value()
            except Exception as error:
                value = RankLostError(rank, self.hosts.get(rank, "unknown host"), f"no answer to {what}: {error}")
            else:
                try:
                    value = decode(value) if decode else value
                except Exception as error:
                    value = RuntimeFailure(f"could not read the result of {what} from rank {rank}: {error}")
            if isinstance(value, RemoteFailure):
                value = WorkerError(
                    role=value.role, method=value.method, rank=value.rank, error=value.error, traceback=value.traceback
                )
            if isinstance(value, RuntimeFailure):
                self._fail(value)
            outcome.set_result(value)
            with self._changed:
                self._changed.notify_all()

        raw.add_done_callback(done)
        return outcome

    def _decode(self, payload: bytes) -> Any:
        with self._lock:
            self.bytes_received += len(payload)
        return pickle.loads(payload)

    def wait(self, futures: dict[int, torch.futures.Future], timeout: float | None, description: str) -> None:
        """Block until every future is done; raises the job's failure, or ``CallTimeout`` naming the ranks still
        running."""
        limit = self._call_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._changed:
            while True:
                self._raise_if_failed()
                waiting = [rank for rank, future in futures.items() if not future.done()]
                if not waiting:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CallTimeout(
                        f"{description} did not finish within {limit:g} s; still running on ranks {waiting}. "
                        f"Raise the timeout (runtime.call_timeout_s or result(timeout=...)) if this is expected"
                    )
                self._changed.wait(min(remaining, 1.0))

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _fail(self, failure: RuntimeFailure, *, waited: bool = False) -> None:
        if not waited and isinstance(failure, WorkerError) and failure.peer_lost:
            timer = threading.Timer(PEER_REPORT_GRACE_S, self._fail, args=(failure,), kwargs={"waited": True})
            timer.daemon = True  # the rank's loss, named by its connection, usually comes first (PEER_REPORT_GRACE_S)
            timer.start()
            return
        with self._changed:
            first = self.failure is None
            if first:
                self.failure = failure
            self._changed.notify_all()
        if first and self.on_failure is not None:
            self.on_failure(failure)

    def _send_to_all(self, command: Any) -> dict[int, torch.futures.Future]:
        return {rank: self._send(rank, seq, command) for rank, seq in self._reserve(range(self.world_size)).items()}

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait until every rank has run every command issued so far (a no-op command through each queue)."""
        self.wait(self._send_to_all(Exchanges([])), timeout, "wait_all")

    def stop_workers(self, timeout: float) -> None:
        """Ask every executor to stop after the commands already queued; wait for all of them."""
        self.wait(self._send_to_all(Stop()), timeout, "shutdown")


def _chain(source: torch.futures.Future, target: torch.futures.Future) -> None:
    source.add_done_callback(lambda future: target.set_result(future.value()))


def _gather(futures: list[CallFuture]) -> torch.futures.Future:
    return torch.futures.collect_all([rank_future for f in futures for rank_future in f.rank_futures.values()])


def _as_batch_ref(future: CallFuture, timeout: float | None = None) -> BatchRef:
    value = future.result(timeout) if not future.done() else future.resolved()
    if not isinstance(value, BatchRef):
        raise RuntimeFailure(
            f"{future.description} returned {type(value).__name__} values, not a Batch, so it "
            f"cannot feed another role's data-parallel call"
        )
    return value


def _batch_bytes(batch: Batch) -> int:
    tensor_bytes = sum(value.numel() * value.element_size() for value in batch.tensors.values())
    return tensor_bytes + (len(pickle.dumps(batch.non_tensors)) if batch.non_tensors else 0)
