"""Control and data planes: launch under torchrun, ordered executors, roles on DeviceMesh pools, dispatch, transfers."""

from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime.coordinator import Coordinator
from spmd_rlhf.runtime.dispatch import Dispatch, all_to_all, data_parallel, dispatch_mode, one_to_all, rank_zero
from spmd_rlhf.runtime.errors import CallTimeout, RankLostError, RuntimeFailure, WorkerError
from spmd_rlhf.runtime.futures import wait_together
from spmd_rlhf.runtime.handles import BatchRef, CallFuture, RoleHandle
from spmd_rlhf.runtime.launch import REQUEUE_EXIT_CODE, RuntimeOptions, end_process, launch, stop_requested
from spmd_rlhf.runtime.layout import ResourcePool
from spmd_rlhf.runtime.payload import PayloadError
from spmd_rlhf.runtime.worker import RoleContext, Worker

__all__ = [
    "REQUEUE_EXIT_CODE",
    "BatchRef",
    "CallFuture",
    "CallTimeout",
    "Coordinator",
    "Dispatch",
    "ParallelDims",
    "PayloadError",
    "RankLostError",
    "ResourcePool",
    "RoleContext",
    "RoleHandle",
    "RuntimeFailure",
    "RuntimeOptions",
    "Worker",
    "WorkerError",
    "all_to_all",
    "data_parallel",
    "dispatch_mode",
    "end_process",
    "launch",
    "one_to_all",
    "rank_zero",
    "stop_requested",
    "wait_together",
]
