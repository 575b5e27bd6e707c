"""Control and data planes: launch under torchrun, ordered executors, roles on DeviceMesh pools, dispatch, transfers."""

from .coordinator import Coordinator
from .dispatch import Dispatch, all_to_all, data_parallel, dispatch_mode, one_to_all, rank_zero
from .errors import CallTimeout, RankLostError, RuntimeFailure, WorkerError
from .futures import wait_together
from .handles import BatchRef, CallFuture, RoleHandle
from .launch import REQUEUE_EXIT_CODE, RuntimeOptions, launch, stop_requested
from ..parallel_dims import ParallelDims
from .layout import ResourcePool
from .payload import PayloadError
from .worker import RoleContext, Worker

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
    "launch",
    "one_to_all",
    "rank_zero",
    "stop_requested",
    "wait_together",
]
