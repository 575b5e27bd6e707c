"""Asynchronous GRPO on 4 CPU ranks (2 training: actor and reference; 2 rollout replicas beside the rule reward):
with algorithm.max_staleness=0 the split run's metrics equal the colocated synchronous run's exactly; with
max_staleness=1 it learns the tiny task, every batch is exactly one update old after the first, the bound holds for
every token, and the importance weights are reported; resumed from a checkpoint with a batch in flight, it continues
exactly as the uninterrupted run. PPO takes the same switches, its critic placed beside the rollout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from torchrun_helpers import run_recipe

SHORT = ("trainer.val_every=0", "trainer.save_every=1000")
SPLIT = ("placement=split", "rollout.enabled=true", "rollout.n_ranks=2")
ONE_STEP_OFF = ("trainer.total_steps=40", "trainer.val_every=0", "trainer.save_every=20", *SPLIT,
                "algorithm.max_staleness=1", "rollout.recompute_log_probs=true")
TIMING_PREFIXES = ("time/", "throughput/", "coordinator/")


def without_timings(record: dict) -> dict:
    return {key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)}


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]


def mean_reward(records: list[dict]) -> float:
    return sum(record["reward/mean"] for record in records) / len(records)


def test_split_with_staleness_zero_gives_the_colocated_runs_results(tmp_path: Path):
    colocated = run_recipe("grpo", tmp_path / "colocated", "trainer.total_steps=3", *SHORT)
    split = run_recipe("grpo", tmp_path / "split", "trainer.total_steps=3", *SHORT, *SPLIT, nproc=4)
    for synchronous, asynchronous in zip(colocated, split, strict=True):
        common = without_timings(synchronous)
        assert {key: asynchronous[key] for key in common} == common
        assert asynchronous["off_policy/staleness_max"] == 0 and asynchronous["weight_sync/bytes"] > 0


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory) -> Path:
    """40 steps of k = 1, saving at steps 20 and 40; the run directory."""
    workdir = tmp_path_factory.mktemp("async") / "k1"
    run_recipe("grpo", workdir, *ONE_STEP_OFF, nproc=4)
    return workdir


def test_one_step_off_learns_within_the_staleness_bound(one_step_off: Path):
    records = metrics(one_step_off)
    assert mean_reward(records[-5:]) > mean_reward(records[:5]) + 0.05
    assert [record["off_policy/batch_staleness"] for record in records] == [0.0] + [1.0] * 39
    assert all(record["off_policy/staleness_max"] <= 1 for record in records)
    # Batch 0 is on policy: engine and trainer log-probs agree to rounding (same model code, same weights).
    assert abs(records[0]["off_policy/importance_weight_max"] - 1) < 1e-5
    assert abs(records[0]["off_policy/importance_weight_min"] - 1) < 1e-5
    assert any(record["off_policy/importance_weight_max"] > 1.0 for record in records[1:])
    assert [record["rollout/policy_version"] for record in records] == [0.0] + list(map(float, range(39)))


def test_resume_takes_back_the_batch_in_flight(one_step_off: Path, tmp_path: Path):
    """At step 20's checkpoint batch 20 is in flight (generated at version 19). Resumed from it, steps 20-39 equal
    the uninterrupted run's, bit for bit."""
    checkpoint = one_step_off / "out" / "step_20"
    assert sorted(path.name for path in (checkpoint / "rollouts").iterdir()) == ["batch_20"]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(one_step_off, resumed_dir)
    shutil.rmtree(resumed_dir / "out" / "step_40")
    (resumed_dir / "out" / "latest").write_text("step_20")
    resumed = run_recipe("grpo", resumed_dir, *ONE_STEP_OFF, nproc=4)
    whole = metrics(one_step_off)
    assert [without_timings(record) for record in resumed] == [without_timings(record) for record in whole]


def test_ppo_runs_two_steps_off_with_its_critic_beside_the_rollout(tmp_path: Path):
    records = run_recipe(
        "ppo", tmp_path / "ppo", "trainer.total_steps=3", *SHORT, *SPLIT, "algorithm.max_staleness=2",
        "rollout.recompute_log_probs=true", nproc=4,
    )
    assert [record["off_policy/batch_staleness"] for record in records] == [0.0, 1.0, 2.0]
    assert all(record["off_policy/staleness_max"] <= 2 and "critic/loss" in record for record in records)
