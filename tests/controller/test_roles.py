"""Typed role handles name every method a recipe calls: each is a dispatched method of the role's worker, and a name
a typed handle does not declare is an error on the coordinator, not a remote call."""

from __future__ import annotations

import inspect

import pytest

from spmd_rlhf.controller.role_handles import WORKERS, ActorHandle
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime import RoleHandle
from spmd_rlhf.runtime.dispatch import dispatch_mode
from spmd_rlhf.runtime.handles import RoleRecord
from spmd_rlhf.workers import ActorWorker


@pytest.mark.parametrize("kind", sorted(WORKERS))
def test_every_typed_method_is_a_dispatched_method_of_its_worker(kind):
    worker, handle = WORKERS[kind]
    methods = [name for name, _ in inspect.getmembers(handle, inspect.isfunction) if name not in vars(RoleHandle)]
    assert methods
    for name in methods:
        dispatch_mode(worker, name)  # raises when the worker lacks it or it has no dispatch mode


def test_a_typed_handle_refuses_a_method_it_does_not_declare():
    handle = ActorHandle(None, RoleRecord("actor", ActorWorker, ParallelDims(dp=1), (0,)), None)
    with pytest.raises(AttributeError, match="ActorHandle has no method 'generate_sequence'"):
        _ = handle.generate_sequence
