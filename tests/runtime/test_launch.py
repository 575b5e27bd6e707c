"""Whole jobs under torchrun: failures end the job with a clear message (worker exception, killed or frozen rank), a
two-agent job works, and the README loop runs."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from torchrun_helpers import alive, environment, free_port, torchrun, torchrun_command


def test_worker_exception_reaches_the_coordinator_with_its_traceback():
    start = time.monotonic()
    finished = torchrun("worker_raises.py", nproc=4, timeout=120)
    output = finished.stdout
    assert finished.returncode != 0, output[-4000:]
    assert "NOT REACHED" not in output
    assert "fragile.reduce_rows failed on rank 2: ValueError: bad row 17" in output
    assert "--- traceback on rank 2 ---" in output
    assert 'raise ValueError("bad row 17")' in output
    # Ranks 0, 1 and 3 were stuck in an all-reduce waiting for rank 2; they were told to stop, not left to time out.
    assert time.monotonic() - start < 60


def _two_agents(program: str, *args: str, timeout: float) -> list[subprocess.CompletedProcess]:
    port = free_port()
    command = torchrun_command(program, *args, nproc=2, nnodes=2, port=port)
    agents = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
        for _ in range(2)
    ]
    results = []
    for agent in agents:
        output, _ = agent.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(command, agent.returncode, output))
    return results


def test_two_torchrun_agents_form_one_job(tmp_path):
    out = tmp_path / "two_nodes.json"
    agents = _two_agents("two_nodes.py", str(out), timeout=180)
    for agent in agents:
        assert agent.returncode == 0, agent.stdout[-4000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 4
    # Consumer pool [1, 2, 3, 0]: each rank's group (agent) and local rank as torchrun assigned them.
    assert sorted({entry["group_rank"] for entry in result["where"]}) == [0, 1]
    checks = result["check"]
    assert [entry["ids"] for entry in checks] == [[0, 1, 2], [3, 4, 5]]
    # The TP all-reduce doubles the sum of squares of the replica's rows, proving both TP ranks saw the same rows.
    assert [entry["tp_sum"] for entry in checks] == [2 * (0 + 1 + 4), 2 * (9 + 16 + 25)]
    assert [entry["notes"] for entry in checks] == [["from 0"], ["from 1"]]


@pytest.mark.parametrize("victim", [3, 0])
def test_killed_rank_ends_the_job_and_leaves_no_process(tmp_path, victim):
    start = time.monotonic()
    agents = _two_agents("rank_killed.py", str(tmp_path), str(victim), timeout=120)
    elapsed = time.monotonic() - start
    output = "\n".join(agent.stdout for agent in agents)
    assert all(agent.returncode != 0 for agent in agents), output[-4000:]
    assert "NOT REACHED" not in output
    if victim != 0:  # a dead rank 0 takes its agent (and the rendezvous store) down, and the other agent with it
        assert re.search(r"rank [23] \(.*\) was lost", output), output[-4000:]
    assert elapsed < 60  # failure_timeout_s=10 in the program; the call itself would sleep 120 s
    pids = [int(path.read_text()) for path in tmp_path.glob("pid.*")]
    assert len(pids) == 4
    time.sleep(1.0)
    assert [pid for pid in pids if alive(pid)] == []


def test_workers_exit_on_their_own_when_the_coordinator_goes_silent(tmp_path):
    # Rank 0 freezes itself (SIGSTOP): torchrun sees a live process, so only our watchdog can end ranks 1-3.
    command = torchrun_command("rank_killed.py", str(tmp_path), "0", "SIGSTOP", nproc=4, port=free_port())
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pid.*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = {int(path.name.split(".")[1]): int(path.read_text()) for path in tmp_path.glob("pid.*")}
        assert len(pids) == 4
        workers_alive = lambda: [rank for rank in (1, 2, 3) if alive(pids[rank])]
        while workers_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not workers_alive()
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        output, _ = agent.communicate(timeout=60)
    assert agent.returncode != 0
    # The first worker to notice exits; torchrun then stops the others, often before their own watchdogs fire.
    assert output.count("no word from the coordinator (rank 0)") >= 1, output[-4000:]


def test_the_readme_loop_runs():
    finished = torchrun("readme_loop.py", nproc=4)
    assert finished.returncode == 0, finished.stdout[-4000:]
    assert "[12.0, 44.0]" in finished.stdout
    assert "tensor([ 0.,  2.,  4.,  6.,  8., 10., 12., 14.])" in finished.stdout
