"""The SLURM template (recipes/slurm/*.sbatch) without SLURM: it parses, it renders the launch line from a job's
SLURM_* variables, it passes SIGUSR1 and SIGTERM to the run and requeues the job when the run stopped on one (exit
code 75 or stopped.json), and the line it renders trains: two torchrun agents ("nodes") of one
CPU rank each run GRPO steps, and the same job run again (as a requeue runs it) resumes from ``latest``.

``scontrol`` and ``srun`` are stubs written into tmp_path and put first on PATH. The srun stub records its arguments
and, when asked to, runs the command it was given once per node, as srun does with ``--ntasks-per-node=1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_helpers import RECIPES, alive, environment, free_port

TEMPLATES = sorted((RECIPES / "slurm").glob("*.sbatch"))
TRAIN = RECIPES / "slurm" / "train.sbatch"
REPO = RECIPES.parent
JOB_ID = 4242
TEMPLATE_VARIABLES = ("RECIPE", "REPO_DIR", "CONFIG", "OUTPUT_DIR", "GPUS_PER_NODE", "RDZV_PORT", "TORCHRUN", "VENV")

SCONTROL = """#!/usr/bin/env bash
# show hostnames LIST: the job's hosts, one a line; requeue ID: recorded.
case "$1" in
    show) printf '%s\\n' $FAKE_HOSTS ;;
    requeue) echo "requeue $2" >> "$FAKE_SLURM_DIR/scontrol.log" ;;
    *) exit 1 ;;
esac
"""

SRUN = f"""#!{sys.executable}
import itertools, json, os, signal, subprocess, sys, time
from pathlib import Path

out = Path(os.environ["FAKE_SLURM_DIR"])
arguments = sys.argv[1:]
exported = {{key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "NCCL_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}}
(out / "srun.json").write_text(json.dumps({{"argv": arguments, "env": exported}}))
mode = os.environ.get("FAKE_SRUN", "record")
if mode == "sleep":  # a run that, told to stop, saves and stops as the ranks do (stopped.json; torchrun exits 1)
    def stop(number, frame):
        (out / "srun_signal.txt").write_text(signal.Signals(number).name)
        output_dir = Path(next(argument.split("=", 1)[1] for argument in arguments \
if argument.startswith("trainer.output_dir=")))
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "stopped.json").write_text("{{}}")
        sys.exit(1)
    signal.signal(signal.SIGUSR1, stop)
    signal.signal(signal.SIGTERM, stop)
    (out / "srun.pid").write_text(str(os.getpid()))
    time.sleep(120)
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))
if mode == "run":
    options = list(itertools.takewhile(lambda argument: argument.startswith("--"), arguments))
    nodes = int(dict(option[2:].split("=", 1) for option in options)["nodes"])
    command = arguments[len(options):]
    logs = [(out / f"node{{node}}.log").open("w") for node in range(nodes)]
    agents = [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    codes = [agent.wait(timeout=300) for agent in agents]
    (out / "exit_codes.json").write_text(json.dumps(codes))
    sys.exit(max(codes))
"""


def fake_slurm(tmp_path: Path, **variables: str) -> dict[str, str]:
    """The environment of a batch script in a 2-node job whose srun and scontrol are the stubs above."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    job_environment = {
        key: value
        for key, value in environment(recipe=True).items()  # the job's ranks run a recipe
        if not key.startswith(("SLURM_", "NCCL_")) and key not in TEMPLATE_VARIABLES
    }
    job_environment.update(
        PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path),
        FAKE_HOSTS="gpu-a17 gpu-b03",
        SLURM_JOB_ID=str(JOB_ID),
        SLURM_JOB_NODELIST="gpu-a17,gpu-b03",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="h100:4",
        SLURM_CPUS_PER_TASK="32",
        SLURM_SUBMIT_DIR=str(REPO),
        OMP_NUM_THREADS="1",
    )
    job_environment.update(variables)
    return job_environment


def submit(tmp_path: Path, *overrides: str, timeout: float = 30, **variables: str) -> subprocess.CompletedProcess:
    """Run train.sbatch as the batch step of a fake job, in ``tmp_path``."""
    return subprocess.run(
        ["bash", str(TRAIN), *overrides],
        cwd=tmp_path,
        env=fake_slurm(tmp_path, **variables),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_template_parses(template):
    checked = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_launch_line(tmp_path):
    finished = submit(tmp_path, "actor.lr=1e-6", "trainer.save_every=50", RECIPE="ppo", OUTPUT_DIR="/shared/runs/ppo1")
    assert finished.returncode == 0, finished.stdout
    launch = json.loads((tmp_path / "srun.json").read_text())
    # The default launcher's own torchrun: torch >= 2.12's takes the grace (the next test: an older one's line).
    usage = subprocess.run(
        ["python", "-m", "torch.distributed.run", "--help"], env=fake_slurm(tmp_path), capture_output=True, text=True
    )
    new_torchrun = usage.returncode or "--shutdown-timeout" in usage.stdout
    grace, stop = (["--shutdown-timeout=115"], []) if new_torchrun else ([], ["trainer.stop_timeout_s=25"])
    assert launch["argv"] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        "--kill-on-bad-exit=1",
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=gpu-a17:{29500 + JOB_ID % 1000}",
        f"--rdzv-id={JOB_ID}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        *grace,
        f"{REPO}/recipes/ppo.py",
        "--config",
        f"{REPO}/recipes/configs/ppo.yaml",
        "trainer.output_dir=/shared/runs/ppo1",
        *stop,
        "actor.lr=1e-6",
        "trainer.save_every=50",
    ]
    assert launch["env"] == {"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_defaults_and_overridable_lines(tmp_path):
    finished = submit(
        tmp_path,
        RECIPE="safe_rlhf",
        CONFIG="my.yaml",
        GPUS_PER_NODE="2",
        RDZV_PORT="6000",
        TORCHRUN="/opt/env/bin/torchrun",
        SLURM_GPUS_PER_NODE="8",
        OMP_NUM_THREADS="",
    )
    assert finished.returncode == 0, finished.stdout
    launch = json.loads((tmp_path / "srun.json").read_text())
    argv = launch["argv"]
    assert argv[4:6] == ["/opt/env/bin/torchrun", "--nnodes=2"]
    assert "--nproc-per-node=2" in argv and "--rdzv-endpoint=gpu-a17:6000" in argv
    assert argv[-4:] == [f"{REPO}/recipes/safe_rlhf.py", "--config", "my.yaml", "trainer.output_dir=outputs/safe_rlhf"]
    assert launch["env"]["OMP_NUM_THREADS"] == "16"  # 32 CPUs / 2 ranks


def test_a_torchrun_without_shutdown_timeout_gets_a_stop_within_its_fixed_grace(tmp_path):
    """torch < 2.12's torchrun (the GPU machines' 2.11) takes no --shutdown-timeout and gives its ranks 30 s after a
    signal: the line leaves the option out and asks the run to stop within 25 s, which an argument of the user's
    still overrides."""
    old_torchrun = tmp_path / "torchrun"
    old_torchrun.write_text("#!/usr/bin/env bash\necho 'usage: torchrun [--signals-to-handle SIGNALS_TO_HANDLE]'\n")
    old_torchrun.chmod(0o755)
    finished = submit(tmp_path, "trainer.stop_timeout_s=20", TORCHRUN=str(old_torchrun))
    assert finished.returncode == 0, finished.stdout
    assert "no --shutdown-timeout (torch < 2.12)" in finished.stdout
    argv = json.loads((tmp_path / "srun.json").read_text())["argv"]
    assert not any(argument.startswith("--shutdown-timeout") for argument in argv)
    assert argv[-2:] == ["trainer.stop_timeout_s=25", "trainer.stop_timeout_s=20"]  # the later one wins


def test_unknown_recipe_is_refused_before_srun(tmp_path):
    finished = submit(tmp_path, RECIPE="dpo")
    assert finished.returncode != 0
    assert "RECIPE=dpo has no" in finished.stdout and "ppo, grpo, remax or safe_rlhf" in finished.stdout
    assert not (tmp_path / "srun.json").exists()


@pytest.mark.parametrize("signal_name", ["SIGUSR1", "SIGTERM"])
def test_a_signal_is_passed_to_the_run_and_its_stop_requeues_the_job(tmp_path, signal_name):
    log, pid_file = tmp_path / "job.log", tmp_path / "srun.pid"
    with log.open("w") as output:  # a file, not a pipe: the sleeping srun stub outlives the batch shell
        job = subprocess.Popen(
            ["bash", str(TRAIN)],
            cwd=tmp_path,
            env=fake_slurm(tmp_path, FAKE_SRUN="sleep"),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(getattr(signal, signal_name))  # SIGUSR1: what --signal=B:USR1@120 sends the batch shell
        job.wait(timeout=20)
    finally:
        job.kill()
        if pid_file.exists() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert job.returncode == 0, log.read_text()
    assert (tmp_path / "srun_signal.txt").read_text() == signal_name  # passed on to srun, and so to the ranks
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {JOB_ID}\n"
    assert "resumes from outputs/grpo/latest" in log.read_text()


@pytest.mark.parametrize(("srun_exit", "requeued"), [(75, True), (1, False), (0, False)])
def test_only_the_requeue_exit_code_or_a_stop_marker_requeues(tmp_path, srun_exit, requeued):
    """A one-rank run's 75 requeues; a failure (1 without stopped.json) or a finished run (0) ends the job with it.
    A stopped.json left by an earlier run does not count: the script removes it before the launch."""
    (tmp_path / "outputs" / "grpo").mkdir(parents=True)
    (tmp_path / "outputs" / "grpo" / "stopped.json").write_text("{}")
    finished = submit(tmp_path, FAKE_SRUN=f"exit:{srun_exit}", REPO_DIR=str(REPO))
    assert finished.returncode == (0 if requeued else srun_exit), finished.stdout
    assert (tmp_path / "scontrol.log").exists() == requeued, finished.stdout


def test_two_nodes_train_and_the_job_run_again_resumes(tmp_path):
    """The rendered line, run as srun would on two "nodes" of one CPU rank each (tests/runtime/test_launch.py runs two
    of two): GRPO steps; then the job again, as a requeue runs it (here with one step more), continues from
    ``latest``."""
    tiny_run = (
        "trainer.val_every=0",
        "trainer.save_every=0",
        "rollout.n=4",
        "data.batch_size=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=8",
        "reference.micro_batch_size=8",
    )
    variables = dict(
        FAKE_SRUN="run",
        FAKE_HOSTS="127.0.0.1 127.0.0.2",
        SLURM_GPUS_PER_NODE="1",
        SLURM_CPUS_PER_TASK="1",
        REPO_DIR=str(REPO),
        SLURM_SUBMIT_DIR=str(tmp_path),
        OUTPUT_DIR="out",
        TORCHRUN=f"{sys.executable} -m torch.distributed.run",
    )
    for total_steps in (1, 2):
        steps = f"trainer.total_steps={total_steps}"
        finished = submit(tmp_path, steps, *tiny_run, timeout=240, RDZV_PORT=str(free_port()), **variables)
        nodes = "\n".join((tmp_path / f"node{node}.log").read_text()[-3000:] for node in range(2))
        assert finished.returncode == 0, finished.stdout + nodes
        assert json.loads((tmp_path / "exit_codes.json").read_text()) == [0, 0], nodes
        assert "--rdzv-endpoint=127.0.0.1:" in finished.stdout
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # Step 0, then the second job found out/latest = step_1 and ran only step 1.
    assert [record["step"] for record in records] == [0, 1]
    assert (tmp_path / "out" / "latest").read_text() == "step_2"
    assert (tmp_path / "out" / "step_1" / "actor" / "model.safetensors").is_file()
