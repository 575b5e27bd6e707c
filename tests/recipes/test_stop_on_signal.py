"""A run stopped by a signal loses nothing: SIGTERM to the torchrun agent (which forwards it to every rank) or SIGUSR1
to one worker rank mid-run makes the coordinator save after the step in flight and exit with the requeue code; the
same command run again resumes from that save and ends with the metrics of an uninterrupted run. A rank killed
mid-save loses only the steps since the checkpoint before: torchrun's next round (``--max-restarts``) resumes from
it and ends with the uninterrupted run's parameters, bit for bit. Two CPU ranks, the tiny GRPO recipe: five short
runs, one of them restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torchrun_helpers import RECIPES, TIMING_PREFIXES, environment, free_port, run_recipe, torchrun_command

from spmd_rlhf.runtime import REQUEUE_EXIT_CODE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fault_soak import final_weights, run_faulty_grpo, struck_faults, training_rows  # noqa: E402

RUN = ("trainer.total_steps=4", "trainer.val_every=0", "trainer.save_every=0", "algorithm.kl_target=0.001")
"""No periodic saves: the only checkpoint before the last step is the one the signal asks for."""


def without_timings(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)} for record in records]


@pytest.fixture(scope="module")
def uninterrupted_dir(tmp_path_factory) -> Path:
    """The workdir of an uninterrupted run of ``RUN``; its run directory is ``out``."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    run_recipe("grpo", workdir, *RUN)
    return workdir


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_dir) -> list[dict]:
    return [json.loads(line) for line in (uninterrupted_dir / "out" / "metrics.jsonl").read_text().splitlines()]


def rank_pids(agent: subprocess.Popen) -> dict[int, int]:
    """{global rank: pid} of the agent's rank processes."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        variables = dict(
            entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry
        )
        ranks[int(variables["RANK"])] = pid
    return ranks


def stop_mid_run(
    workdir: Path, send: Callable[[subprocess.Popen], None], *overrides: str
) -> subprocess.CompletedProcess:
    """Start the run, wait until its first step is logged, ``send(agent)`` a signal, and wait for the job to end."""
    metrics = workdir / "out" / "metrics.jsonl"
    command = torchrun_command(
        str(RECIPES / "grpo.py"),
        "--config",
        str(RECIPES / "configs" / "grpo.yaml"),
        "trainer.output_dir=out",
        *RUN,
        *overrides,
        nproc=2,
        port=free_port(),
    )
    with (workdir / "stopped.log").open("w") as log:
        agent = subprocess.Popen(
            command, cwd=workdir, env=environment(recipe=True), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 120
            while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
                assert agent.poll() is None, (workdir / "stopped.log").read_text()[-4000:]
                time.sleep(0.05)
            send(agent)
            agent.wait(timeout=120)
        finally:
            agent.kill()
    return subprocess.CompletedProcess(command, agent.returncode, (workdir / "stopped.log").read_text())


def stopped_step(stopped: subprocess.CompletedProcess, run_dir: Path, reasons: tuple[str, ...]) -> int:
    """The step the stopped run saved, after checking its marker, ``latest`` and what it printed."""
    assert stopped.returncode != 0, stopped.stdout[-4000:]
    marker = json.loads((run_dir / "stopped.json").read_text())
    step = marker["step"]
    assert marker["reason"] in reasons, marker
    assert step in (1, 2, 3), marker  # stopped mid-run: after the first logged step, before the last
    assert (run_dir / "latest").read_text() == f"step_{step}"
    # The checkpoint the marker names holds that step's state, not an earlier save's.
    assert json.loads((run_dir / f"step_{step}" / "trainer_state.json").read_text())["step"] == step
    assert f"stopped after step {step} of 4; a relaunch continues from step_{step}" in stopped.stdout
    return step


def test_sigterm_mid_run_saves_and_a_relaunch_ends_as_an_uninterrupted_run(tmp_path, uninterrupted):
    """SIGTERM to the torchrun agent, as SLURM, Kubernetes or a user's kill sends it; torchrun forwards it to both
    ranks."""
    stopped = stop_mid_run(tmp_path, lambda agent: agent.send_signal(signal.SIGTERM))
    stopped_step(stopped, tmp_path / "out", ("SIGTERM on rank 0", "SIGTERM on rank 1"))
    resumed = run_recipe("grpo", tmp_path, *RUN)  # the same command again, as a requeued job runs it
    assert [record["step"] for record in resumed] == list(range(4))  # cut back to the save: no step twice
    assert without_timings(resumed) == without_timings(uninterrupted)
    assert not (tmp_path / "out" / "stopped.json").exists()


def test_sigusr1_to_one_worker_rank_stops_the_job_with_the_requeue_code(tmp_path):
    """SLURM's --signal=USR1@N reaches every task; a worker's signal reaches the coordinator over RPC. The agent was
    not signalled, so it reports rank 0's exit code."""
    stopped = stop_mid_run(tmp_path, lambda agent: os.kill(rank_pids(agent)[1], signal.SIGUSR1))
    stopped_step(stopped, tmp_path / "out", ("SIGUSR1 on rank 1",))
    assert f"exitcode  : {REQUEUE_EXIT_CODE}" in stopped.stdout, stopped.stdout[-4000:]


def test_a_stop_that_outlasts_stop_timeout_s_exits_at_once_with_the_requeue_code(tmp_path):
    """The wait for the step in flight is bounded: past trainer.stop_timeout_s the job ends without that save."""
    stopped = stop_mid_run(
        tmp_path, lambda agent: os.kill(rank_pids(agent)[1], signal.SIGUSR1), "trainer.stop_timeout_s=0.01"
    )
    assert "did not end within 0.01 s of SIGUSR1 on rank 1 (trainer.stop_timeout_s)" in stopped.stdout, stopped.stdout[
        -4000:
    ]
    assert f"exitcode  : {REQUEUE_EXIT_CODE}" in stopped.stdout
    assert not (tmp_path / "out" / "stopped.json").exists()
    latest = tmp_path / "out" / "latest"
    assert not latest.exists() or (tmp_path / "out" / latest.read_text() / "trainer_state.json").is_file()


KILLED_MID_SAVE = {"round": 0, "rank": 1, "at": "save_checkpoint", "call": 3, "kind": "SIGKILL"}
"""With a save after every step the third is step_3's: rank 1 dies with its shards written into step_3.tmp, before
trainer_state.json (``benchmarks/faulty_grpo.py`` injects it)."""


def test_a_rank_killed_mid_save_restarts_from_the_previous_checkpoint_and_ends_as_an_uninterrupted_run(
    tmp_path, uninterrupted_dir, monkeypatch
):
    for key, value in environment(recipe=True).items():  # run_faulty_grpo's ranks inherit this process's environment
        monkeypatch.setenv(key, value)
    overrides = [*RUN, "trainer.save_every=1", "trainer.keep_last=0"]
    faulted = run_faulty_grpo(tmp_path, "out", overrides, plan=[KILLED_MID_SAVE], nproc=2, timeout_s=300)
    assert faulted.returncode == 0, faulted.stdout[-6000:]
    assert [fault["at"] for fault in struck_faults(tmp_path, "out")] == ["save_checkpoint"]
    assert "was lost" in faulted.stdout  # the first round ended on the lost rank ...
    assert "resuming from out/step_2" in faulted.stdout  # ... and the next took the checkpoint before the cut save
    run_dir = tmp_path / "out"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # the metrics file goes on from the checkpoint: no step twice
    assert [(row["faults/restarts"], row["faults/steps_redone"]) for row in rows] == [(0, 0), (0, 0), (1, 1), (1, 1)]
    assert training_rows(run_dir) == training_rows(uninterrupted_dir / "out")
    assert json.loads((run_dir / "step_3" / "trainer_state.json").read_text())["step"] == 3  # saved again, whole
    assert not list(run_dir.glob("*.tmp"))
    expected, final = final_weights(uninterrupted_dir / "out"), final_weights(run_dir)
    assert expected.keys() == final.keys()
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name
