"""The one entry point every rank calls: ``launch(main)``.

    torchrun --nproc-per-node 4 my_loop.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 my_loop.py

Every rank picks its device from ``RuntimeOptions.device`` (``runtime.device.select_device``: cpu -> gloo;
cuda -> ``cuda:<LOCAL_RANK>`` with NCCL for device tensors and gloo for host ones), binds its threads to it, joins the
global process group and RPC (TensorPipe) over this launch round's store (``runtime.rendezvous.round_store``: a round
that ``torchrun --max-restarts`` starts again never reads the keys of the round that failed) and starts its executor.
Rank 0 runs ``main(coordinator)`` on its main thread while its executor serves as a worker; the other ranks serve
until the coordinator stops them. Run without torchrun, it is a one-rank job.

Failure handling: the coordinator pings every rank; a worker exception, a lost rank, or an exception in ``main``
prints one error naming the rank, then every reachable rank exits with code 1 (``os._exit``: a rank stuck in a
collective cannot be unwound politely). A worker that hears nothing from the coordinator for
``failure_timeout_s`` exits on its own, so no process outlives the job.

Stopping on a signal: SIGTERM or SIGUSR1 on any rank (torchrun forwards SIGTERM to its ranks, and SIGUSR1 with
``--signals-to-handle``; SLURM can signal every task) reaches the coordinator, where ``stop_requested()`` tells the
recipe's loop to save after the step in flight and end; the process then exits with ``REQUEUE_EXIT_CODE``. A stop that
takes longer than ``RuntimeOptions.stop_timeout_s`` ends the job with that code at once, without the save.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.distributed.rpc as rpc

from spmd_rlhf.runtime.coordinator import Coordinator
from spmd_rlhf.runtime.device import bind_thread, select_device, steady_attention_kernels, visible_cuda_devices
from spmd_rlhf.runtime.errors import RankLostError, RuntimeFailure
from spmd_rlhf.runtime.executor import Executor
from spmd_rlhf.runtime.rendezvous import depart, round_store, rpc_init_method

Result = TypeVar("Result")


@dataclass
class RuntimeOptions:
    failure_timeout_s: float = 60.0
    """A rank that leaves the coordinator's heartbeat unanswered this long (or a worker that hears nothing from the
    coordinator this long) ends the job with code 1."""
    call_timeout_s: float = 3600.0
    """Default limit of any wait on the coordinator (``CallFuture.result()`` without a timeout)."""
    collective_timeout_s: float = 1800.0
    """Process-group timeout: a collective stuck this long raises on the ranks in it."""
    device: str = "auto"
    """auto (cuda when a GPU is visible, else cpu), cuda (an error without one) or cpu (gloo only, even on a GPU
    machine)."""
    shutdown_timeout_s: float = 60.0
    """Limit for draining the executors and shutting RPC down at the end."""
    rpc_threads: int = 16
    stop_timeout_s: float = 100.0
    """After SIGTERM/SIGUSR1, the job exits with ``REQUEUE_EXIT_CODE`` this many seconds later at the latest."""


REQUEUE_EXIT_CODE = 75
"""The exit code of a run stopped by SIGTERM/SIGUSR1 (EX_TEMPFAIL): it saved, or kept its last checkpoint, and a
relaunch continues it. recipes/slurm/train.sbatch requeues the job on it."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


_state: dict[str, object] = {
    "executor": None,
    "last_heard": time.monotonic(),
    "rank": 0,
    "world_size": 1,
    "stop_reason": None,
    "stop_timer": None,
    "store": None,  # this launch round's store (rendezvous.round_store): rank 0 may host it
}
_stop_lock = threading.Lock()


def stop_requested() -> str | None:
    """On the coordinator: why the job was asked to stop (``"SIGTERM on rank 1"``), or None. The recipe's loop reads
    it between steps, saves, and ends."""
    return _state["stop_reason"]


def _request_stop(reason: str, timeout_s: float) -> None:
    """Record the first stop request on the coordinator and start the clock that bounds it."""
    with _stop_lock:
        if _state["stop_reason"] is not None:
            return
        _state["stop_reason"] = reason
        _say(
            f"{reason}: saving after the step in flight, then exiting with code {REQUEUE_EXIT_CODE} "
            f"(within {timeout_s:g} s)"
        )
        timer = threading.Timer(timeout_s, _stop_overdue, args=(reason, timeout_s))
        timer.daemon = True
        _state["stop_timer"] = timer
        timer.start()


def _stop_overdue(reason: str, timeout_s: float) -> None:
    failure = RuntimeFailure(
        f"the step in flight and its save did not end within {timeout_s:g} s of {reason} (trainer.stop_timeout_s); "
        f"exiting without that save: a relaunch resumes from the last checkpoint"
    )
    _abort_job(int(_state["world_size"]), failure, code=REQUEUE_EXIT_CODE)


def _rpc_request_stop(reason: str, timeout_s: float) -> None:
    _request_stop(reason, timeout_s)


def _install_stop_handlers(rank: int, options: RuntimeOptions) -> None:
    """SIGTERM/SIGUSR1 ask the coordinator to stop; another rank tells it over RPC. The handler only starts a thread:
    it runs on the main thread between two bytecodes, perhaps inside a print or a lock the request needs."""

    def tell_coordinator(reason: str, timeout_s: float) -> None:
        try:
            rpc.rpc_sync("rank0", _rpc_request_stop, args=(reason, timeout_s), timeout=10)
        except Exception as error:
            _say(f"could not tell the coordinator about {reason}: {error}")

    def on_signal(number: int, frame: object) -> None:
        reason = f"{signal.Signals(number).name} on rank {rank}"
        request = _request_stop if rank == 0 else tell_coordinator
        threading.Thread(target=request, args=(reason, options.stop_timeout_s), daemon=True).start()

    for number in STOP_SIGNALS:
        signal.signal(number, on_signal)


@rpc.functions.async_execution
def _rpc_submit(seq: int, payload: bytes) -> torch.futures.Future:
    _state["last_heard"] = time.monotonic()
    return _state["executor"].submit(seq, payload, local=False)


def _rpc_ping() -> None:
    _state["last_heard"] = time.monotonic()


def _rpc_describe() -> str:
    return f"{socket.gethostname()}, pid {os.getpid()}"


def _rpc_abort(code: int, reason: str) -> None:
    _say(f"stopping (exit code {code}): {reason}")
    threading.Timer(0.2, end_process, args=(code,)).start()


def stored_batch_count() -> int:
    """How many batches this rank's store holds (diagnostics: results not yet released by the coordinator)."""
    executor = _state["executor"]
    return len(executor.store) if executor is not None else 0


def _say(message: str) -> None:
    print(f"[spmd_rlhf rank {_state['rank']}] {message}", file=sys.stderr, flush=True)


def end_process(code: int = 0) -> None:
    """End this process with ``code`` once its work is done and its process groups are destroyed: stdout and stderr
    flushed, the interpreter's teardown skipped. There a C++ thread of the distributed stack left joinable can abort
    the process ("terminate called without an active exception", seen in recipe runs and test programs under load)
    and turn a finished job into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables, or a one-rank job when they are absent."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError) as error:
        raise RuntimeError(
            f"RANK / WORLD_SIZE / LOCAL_RANK are not usable ({error}); start the job with torchrun"
        ) from error


def bound_new_groups(timeout: timedelta) -> None:
    """Make ``timeout`` what a collective may wait on every process group created from now on without a timeout of
    its own: those of every ``DeviceMesh`` (a role's pp, dp and tp groups, the expert, context and HSDP meshes) take
    ``torch.distributed``'s module default (30 minutes on gloo, 10 on NCCL), not the world group's, so
    ``trainer.collective_timeout_s`` would otherwise bound only collectives over every rank."""
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if hasattr(c10d, name):
            setattr(c10d, name, timeout)


def launch(main: Callable[[Coordinator], Result], *, options: RuntimeOptions | None = None) -> Result | None:
    """Run ``main`` as the coordinator on rank 0 and serve as a worker everywhere; returns ``main``'s value on rank 0
    and ``None`` elsewhere after a clean shutdown. Any failure ends every process with exit code 1."""
    options = options or RuntimeOptions()
    rank, world_size, local_rank = _environment()
    _state["rank"] = rank
    device, backend = select_device(options.device, local_rank=local_rank, cuda_devices=visible_cuda_devices())
    bind_thread(device)
    steady_attention_kernels(device)
    timeout = timedelta(seconds=options.collective_timeout_s)
    executor = Executor(rank, device, collective_timeout=timeout)
    _state["executor"] = executor
    _state["last_heard"] = time.monotonic()
    store = round_store(rank=rank, world_size=world_size, timeout=timeout)
    _state["store"] = store
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size, timeout=timeout
    )
    bound_new_groups(timeout)
    if device.type == "cuda":
        # Form the world group's NCCL communicator now, on every rank: batched point-to-point transfers between a
        # subset of ranks (runtime.transfer) are undefined when they are that group's first NCCL call.
        dist.all_reduce(torch.zeros(1, device=device))
    with warnings.catch_warnings():
        # TensorPipe's own device-map exchange uses a deprecated c10d path; nothing for users to act on.
        warnings.filterwarnings("ignore", message="You are using a Backend")
        rpc.init_rpc(
            f"rank{rank}",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=rpc_init_method(store, "rpc"),
                rpc_timeout=options.failure_timeout_s,
                num_worker_threads=options.rpc_threads,
                # TensorPipe's shared-memory transport busy-polls a core per process; control messages are small.
                _transports=["uv"],
            ),
        )
    _state["world_size"] = world_size
    if threading.current_thread() is threading.main_thread():
        _install_stop_handlers(rank, options)
    if rank == 0:
        return _run_coordinator(main, executor, world_size, options)
    _serve(executor, options)
    return None


def _run_coordinator(
    main: Callable[[Coordinator], Result], executor: Executor, world_size: int, options: RuntimeOptions
) -> Result:
    hosts = {0: _rpc_describe()}
    for rank in range(1, world_size):
        hosts[rank] = rpc.rpc_sync(f"rank{rank}", _rpc_describe, timeout=options.failure_timeout_s)
    coordinator = Coordinator(
        world_size=world_size,
        executor=executor,
        transport=lambda rank, seq, payload: rpc.rpc_async(f"rank{rank}", _rpc_submit, args=(seq, payload), timeout=0),
        call_timeout_s=options.call_timeout_s,
        hosts=hosts,
    )
    coordinator.on_failure = lambda failure: threading.Timer(
        min(10.0, options.failure_timeout_s), _abort_job, args=(world_size, failure)
    ).start()
    stop_heartbeat = threading.Event()
    threading.Thread(
        target=_heartbeat, args=(coordinator, world_size, options, stop_heartbeat), name="spmd-heartbeat", daemon=True
    ).start()
    try:
        result = main(coordinator)
        coordinator.stop_workers(options.shutdown_timeout_s)
    except SystemExit as exit_request:
        if exit_request.code in (0, None):
            coordinator.stop_workers(options.shutdown_timeout_s)
            result = None
        else:
            _abort_job(world_size, RuntimeFailure(f"the coordinator exited with code {exit_request.code}"), code=1)
    except BaseException as error:
        if not isinstance(error, RuntimeFailure):
            _say("the coordinator failed:\n" + traceback.format_exc().rstrip())
        _abort_job(world_size, error)
    stop_heartbeat.set()
    if _state["stop_timer"] is not None:
        _state["stop_timer"].cancel()  # main has returned: the stop it bounded is done
    _shutdown(options)
    return result


def _heartbeat(coordinator: Coordinator, world_size: int, options: RuntimeOptions, stop: threading.Event) -> None:
    interval = options.failure_timeout_s / 6

    def check(rank: int, future: torch.futures.Future) -> None:
        try:
            future.value()
        except Exception as error:
            if not stop.is_set():
                reason = f"no heartbeat answer within {options.failure_timeout_s:g} s ({error})"
                coordinator._fail(RankLostError(rank, coordinator.hosts.get(rank, "unknown host"), reason))

    while not stop.wait(interval):
        for rank in range(1, world_size):
            try:
                future = rpc.rpc_async(f"rank{rank}", _rpc_ping, timeout=options.failure_timeout_s)
            except Exception as error:
                future = torch.futures.Future()
                future.set_exception(error)
            future.add_done_callback(lambda done, rank=rank: check(rank, done))


_abort_lock = threading.Lock()


def _abort_job(world_size: int, failure: BaseException, code: int = 1) -> None:
    """Print the failure once, tell every reachable rank to exit with ``code``, then exit."""
    if not _abort_lock.acquire(blocking=False):
        return
    _say(f"job failed: {failure}")
    reason = str(failure).splitlines()[0]
    notices = []
    for rank in range(1, world_size):
        try:
            notices.append(rpc.rpc_async(f"rank{rank}", _rpc_abort, args=(code, reason), timeout=5))
        except Exception:
            pass
    deadline = time.monotonic() + 5
    for notice in notices:
        while not notice.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    end_process(code)


def _serve(executor: Executor, options: RuntimeOptions) -> None:
    while not executor.stopped.wait(1.0):
        silent = time.monotonic() - _state["last_heard"]
        if silent > options.failure_timeout_s:
            _say(f"no word from the coordinator (rank 0) for {silent:.0f} s; it has probably died. Exiting")
            end_process(1)
    _shutdown(options)


def _shutdown(options: RuntimeOptions) -> None:
    try:
        rpc.shutdown(graceful=True, timeout=options.shutdown_timeout_s)
        dist.destroy_process_group()
        silent = depart(
            _state["store"], rank=_state["rank"], world_size=_state["world_size"], timeout_s=options.shutdown_timeout_s
        )
    except Exception as error:
        _say(f"clean shutdown failed: {error}")
        end_process(1)
    if silent:
        _say(
            f"ranks {silent} did not finish shutting down within {options.shutdown_timeout_s:g} s; rank 0 ends now, "
            "and with it the job's store they may still be using"
        )
