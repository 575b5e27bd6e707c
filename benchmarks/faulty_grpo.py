"""recipes/grpo.py with faults injected into chosen ranks of chosen torchrun rounds, for ``benchmarks/fault_soak.py``
and ``tests/recipes/test_stop_on_signal.py``. Nothing here is part of the package: it wraps actor methods before launch.

    SPMD_RLHF_FAULTS='[{"round": 0, "rank": 1, "at": "save_checkpoint", "call": 2, "kind": "SIGKILL"}]' \\
        torchrun --standalone --nproc-per-node 2 --max-restarts 1 benchmarks/faulty_grpo.py trainer.resume=auto ...

A fault strikes in the torchrun round ``round`` (``TORCHELASTIC_RESTART_COUNT``) on global rank ``rank``, at that
rank's ``call``-th call (counted from 1 in the round) of the actor method ``at`` (``update_actor``,
``save_checkpoint``, ``send_weights``, ...):

- ``SIGKILL``: after the method's work, before it returns (``save_checkpoint``: the role's shards are in the staging
  directory, ``trainer_state.json`` is not; ``update_actor``: the step's update is done but never reported);
- ``SIGTERM``: sent to the rank itself after the method's work, as a scheduler's preemption notice would be;
- ``hang``: before the method's work, the rank's executor blocks for good (a stuck kernel or deadlock: its RPC threads
  still answer), so its peers wait in the method's collectives until ``trainer.collective_timeout_s``.

Each fault that strikes first appends a line to ``SPMD_RLHF_FAULT_LOG`` (when set), so a caller counts what struck.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

from grpo import GRPORecipe  # noqa: E402

from spmd_rlhf.controller import main  # noqa: E402
from spmd_rlhf.workers.actor import ActorWorker  # noqa: E402

KINDS = ("SIGKILL", "SIGTERM", "hang")


def _strike(fault: dict) -> None:
    log = os.environ.get("SPMD_RLHF_FAULT_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(json.dumps({**fault, "time": time.time()}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
    if fault["kind"] == "hang":
        threading.Event().wait()
    os.kill(os.getpid(), getattr(signal, fault["kind"]))


def _wrap(method_name: str, faults: list[dict]) -> None:
    method = getattr(ActorWorker, method_name)
    calls = 0

    @functools.wraps(method)
    def faulty(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        due = [fault for fault in faults if fault["call"] == calls]
        for fault in due:
            if fault["kind"] == "hang":
                _strike(fault)
        result = method(self, *args, **kwargs)
        for fault in due:
            if fault["kind"] != "hang":
                _strike(fault)
        return result

    setattr(ActorWorker, method_name, faulty)


def install_faults(plan: list[dict], *, round_index: int, rank: int) -> None:
    """Wrap the actor methods this rank's faults of this round strike in."""
    mine = [fault for fault in plan if fault["round"] == round_index and fault["rank"] == rank]
    for fault in mine:
        if fault["kind"] not in KINDS or not hasattr(ActorWorker, fault["at"]):
            raise ValueError(f"fault {fault}: kind must be one of {KINDS} and at an ActorWorker method")
    for method_name in sorted({fault["at"] for fault in mine}):
        _wrap(method_name, [fault for fault in mine if fault["at"] == method_name])


if __name__ == "__main__":
    install_faults(
        json.loads(os.environ.get("SPMD_RLHF_FAULTS", "[]")),
        round_index=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        rank=int(os.environ.get("RANK", "0")),
    )
    main(GRPORecipe, str(Path(__file__).resolve().parents[1] / "recipes" / "configs" / "grpo.yaml"))
