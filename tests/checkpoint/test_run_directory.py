"""The run directory belongs to one run: its lock names the holder and keeps a second job from touching the first's
files; a resume is refused when the config changes the data order or the model, or when the run already finished;
``metrics.jsonl`` is cut back to the step resumed from."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from spmd_rlhf import checkpoint
from spmd_rlhf.checkpoint import run_directory
from spmd_rlhf.checkpoint.run_directory import RunDirectoryError, RunLock
from spmd_rlhf.config import load_config, to_yaml
from spmd_rlhf.metrics.sinks import restart_metrics, truncate_metrics

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "grpo.yaml"


def test_a_second_lock_fails_naming_the_holder_and_leaves_the_first_jobs_staging(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    first = RunLock(tmp_path)
    first.acquire()
    staging = tmp_path / "step_5.tmp"  # the first job is saving step 5
    staging.mkdir()
    second = RunLock(tmp_path)
    holder = f"host {socket.gethostname()}, pid {os.getpid()}, SLURM job 777"
    with pytest.raises(RunDirectoryError, match=f"output_dir={tmp_path} is in use by {holder}; wait for"):
        second.acquire()
    assert staging.is_dir()
    first.release()
    second.acquire()  # free again once the holder is gone
    second.release()


def save(run_dir: Path, step: int, overrides: list[str]) -> Path:
    state = {"step": step, "recipe": "grpo"}
    config_yaml = to_yaml(load_config(str(CONFIG), overrides))
    return checkpoint.write_checkpoint(
        run_dir / f"step_{step}", lambda staging: None, trainer_state=state, config_yaml=config_yaml
    )


def check(saved: Path, overrides: list[str]) -> dict:
    config = load_config(str(CONFIG), overrides)
    return run_directory.check_resume(
        saved,
        config_yaml=to_yaml(config),
        total_steps=config.trainer.total_steps,
        allow_changes=config.trainer.resume_allow_changes,
    )


def test_a_resume_that_changes_the_data_order_or_model_is_refused_naming_the_keys(tmp_path):
    saved = save(tmp_path, 4, ["trainer.total_steps=4"])
    # More steps and another learning rate: a resume, with the changes listed.
    changes = check(saved, ["trainer.total_steps=8", "actor.lr=1e-3"])
    assert changes == {"trainer.total_steps": (4, 8), "actor.lr": (2e-3, 1e-3)}
    message = r"step_4 was trained with another data order or model \(data\.seed: 0 saved, 1 now; model\.path: "
    with pytest.raises(RunDirectoryError, match=message + r".*trainer\.resume_allow_changes=true"):
        check(saved, ["trainer.total_steps=8", "data.seed=1", "model.path=other/model"])
    with pytest.raises(RunDirectoryError, match=r"data\.batch_size: 8 saved, 4 now"):
        check(saved, ["trainer.total_steps=8", "data.batch_size=4", "actor.mini_batch_size=64"])
    assert "data.seed" in check(saved, ["trainer.total_steps=8", "data.seed=1", "trainer.resume_allow_changes=true"])


def test_a_finished_run_is_refused_instead_of_running_zero_steps(tmp_path):
    saved = save(tmp_path, 4, ["trainer.total_steps=4"])
    message = r"step_4 already reached step 4 and trainer\.total_steps=4: nothing to run\. To train on from it raise"
    with pytest.raises(RunDirectoryError, match=message):
        check(saved, ["trainer.total_steps=4"])
    with pytest.raises(RunDirectoryError, match="nothing to run"):
        check(saved, ["trainer.total_steps=3"])


def test_a_fresh_start_is_refused_in_a_directory_holding_checkpoints(tmp_path):
    run_directory.check_fresh_start(tmp_path, checkpoint.latest_checkpoint(tmp_path))  # empty: fine
    save(tmp_path, 2, ["trainer.total_steps=4"])
    with pytest.raises(
        RunDirectoryError,
        match=r"trainer\.resume=null, but .* holds an earlier run's checkpoints "
        r"\(latest step_2\); use another trainer\.output_dir",
    ):
        run_directory.check_fresh_start(tmp_path, checkpoint.latest_checkpoint(tmp_path))


def test_metrics_are_cut_back_to_the_step_resumed_from(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "reward/mean": step / 10}) for step in range(6)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "rew')  # the last line torn by a crash
    truncate_metrics(str(tmp_path), 4)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    truncate_metrics(str(tmp_path), 0)
    assert path.read_text() == ""
    truncate_metrics(str(tmp_path / "missing"), 3)  # no file: nothing to do


def test_steps_done_again_are_counted_over_every_resume(tmp_path, monkeypatch):
    """A first launch logged steps 0-5 and resumes from step 4: steps 4 and 5 are done again. A second restart
    resumes from step 7 after steps up to 8 were logged: two more, four in all."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step}) + "\n" for step in range(6)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    first = restart_metrics(truncate_metrics(str(tmp_path), 4), 4)
    assert first == {"faults/restarts": 1, "faults/steps_redone": 2}
    with path.open("a") as handle:
        handle.write("".join(json.dumps({"step": step, **first}) + "\n" for step in range(4, 9)))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_metrics(truncate_metrics(str(tmp_path), 7), 7) == {"faults/restarts": 2, "faults/steps_redone": 4}
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert restart_metrics([], 0) == {"faults/restarts": 0, "faults/steps_redone": 0}  # a fresh run, not under torchrun
