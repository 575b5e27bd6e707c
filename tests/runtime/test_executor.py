"""The per-rank executor in one process: out-of-order delivery runs in sequence order; failures become reports."""

import pickle
import random
import threading
import time

import pytest
import torch

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime.executor import Call, Envelope, Executor, Put, RemoteFailure


@pytest.fixture
def make_executor():
    made = []

    def make(rank=0):
        made.append(Executor(rank=rank, device=torch.device("cpu"), poll_seconds=0.05))
        return made[-1]

    yield make
    for executor in made:
        executor.stopped.set()


class Log:
    def __init__(self):
        self.seen = []

    def record(self, value):
        self.seen.append(value)
        return value

    def fail(self):
        raise KeyError("missing field")


def _call(method, *args):
    return Call("log", method, pickle.dumps((args, {})))


def test_commands_run_in_sequence_order_whatever_the_delivery_order(make_executor):
    executor = make_executor()
    executor.roles["log"] = Log()
    order = list(range(200))
    random.Random(0).shuffle(order)
    futures = {}

    def deliver(seqs):
        for seq in seqs:
            futures[seq] = executor.submit(seq, pickle.dumps(Envelope(seq, _call("record", seq))), local=False)

    threads = [threading.Thread(target=deliver, args=(order[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    values = [pickle.loads(futures[seq].wait()) for seq in range(200)]
    assert values == list(range(200))
    assert executor.roles["log"].seen == list(range(200))


def test_a_raising_method_returns_a_failure_report_and_the_executor_goes_on(make_executor):
    executor = make_executor(rank=3)
    executor.roles["log"] = Log()
    failure = executor.submit(0, Envelope(0, _call("fail")), local=True).wait()
    assert isinstance(failure, RemoteFailure)
    assert (failure.role, failure.method, failure.rank) == ("log", "fail", 3)
    assert failure.error == "KeyError: 'missing field'"
    assert 'raise KeyError("missing field")' in failure.traceback
    assert executor.submit(1, Envelope(1, _call("record", 5)), local=True).wait() == 5


def test_free_drops_stored_batches_before_the_command_runs(make_executor):
    executor = make_executor()
    executor.submit(0, Envelope(0, Put(11, Batch({"x": torch.zeros(2)}))), local=True).wait()
    assert 11 in executor.store
    executor.submit(1, Envelope(1, Put(12, Batch({"x": torch.zeros(2)})), free=[11]), local=True).wait()
    assert sorted(executor.store) == [12]


def test_the_executor_thread_binds_itself_to_the_rank_device(monkeypatch):
    """All role code runs on the executor thread; CUDA's current device is per thread, so it must bind itself."""
    bound = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: bound.append((threading.current_thread().name, device))
    )
    executor = Executor(rank=3, device=torch.device("cuda", 1), poll_seconds=0.05)
    try:
        deadline = time.monotonic() + 10
        while not bound and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bound == [("spmd-executor-rank3", torch.device("cuda", 1))]
    finally:
        executor.stopped.set()
