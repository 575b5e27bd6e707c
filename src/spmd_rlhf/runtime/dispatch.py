"""Dispatch modes of role methods: how a coordinator call is split across a role's ranks and how results come back.

A decorator only records the mode on the function; nothing rewrites the class. The coordinator reads the mode when a
method is called through a role handle.

| mode          | call                                                      | result                                  |
| ------------- | --------------------------------------------------------- | --------------------------------------- |
| one-to-all    | the same arguments on every rank                          | role rank 0's value (or every rank's)   |
| data-parallel | ``Batch`` arguments split by DP rank, same rows on every  | a ``BatchRef`` left where it was made   |
|               | TP / PP rank of a replica; other arguments as given       | (TP rank 0 of the last PP stage), or    |
|               |                                                           | one value per DP rank if not a Batch    |
| all-to-all    | argument ``i`` of rank ``r`` is ``argument[r]``           | every rank's value                      |
| rank-zero     | only role rank 0                                          | its value                               |
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

Method = TypeVar("Method", bound=Callable[..., Any])

_ATTRIBUTE = "__spmd_dispatch__"


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    DATA_PARALLEL = "data_parallel"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"


def _mark(mode: Dispatch) -> Callable[[Method], Method]:
    def decorate(method: Method) -> Method:
        setattr(method, _ATTRIBUTE, mode)
        return method

    return decorate


one_to_all = _mark(Dispatch.ONE_TO_ALL)
data_parallel = _mark(Dispatch.DATA_PARALLEL)
all_to_all = _mark(Dispatch.ALL_TO_ALL)
rank_zero = _mark(Dispatch.RANK_ZERO)


def dispatch_mode(role_class: type, method: str) -> Dispatch:
    """The declared mode of ``role_class.method``; an error naming the fix when it has none."""
    function = getattr(role_class, method, None)
    if function is None:
        raise AttributeError(f"role class {role_class.__qualname__} has no method {method!r}")
    mode = getattr(function, _ATTRIBUTE, None)
    if mode is None:
        raise AttributeError(
            f"{role_class.__qualname__}.{method} has no dispatch mode; decorate it with @one_to_all, "
            f"@data_parallel, @all_to_all or @rank_zero from spmd_rlhf.runtime to call it from the coordinator"
        )
    return mode
