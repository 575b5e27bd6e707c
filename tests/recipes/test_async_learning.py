"""Asynchronous GRPO on 4 CPU ranks (2 training: actor and reference; 2 rollout replicas beside the rule reward):
with algorithm.max_staleness=0 the split run's metrics equal the colocated synchronous run's exactly; with
max_staleness=1 it learns the tiny task, every batch is exactly one update old after the first, the bound holds for
every token, and the importance weights are reported."""

from __future__ import annotations

import shutil
from pathlib import Path

from torchrun_helpers import run_recipe

SHORT = ("trainer.val_every=0", "trainer.save_every=1000")
SPLIT = ("placement=split", "rollout.enabled=true", "rollout.n_ranks=2")
TIMING_PREFIXES = ("time/", "throughput/", "coordinator/")


def without_timings(record: dict) -> dict:
    return {key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)}


def mean_reward(records: list[dict]) -> float:
    return sum(record["reward/mean"] for record in records) / len(records)


def test_split_with_staleness_zero_gives_the_colocated_runs_results(tmp_path: Path):
    colocated = run_recipe("grpo", tmp_path / "colocated", "trainer.total_steps=3", *SHORT)
    split = run_recipe("grpo", tmp_path / "split", "trainer.total_steps=3", *SHORT, *SPLIT, nproc=4)
    for synchronous, asynchronous in zip(colocated, split, strict=True):
        common = without_timings(synchronous)
        assert {key: asynchronous[key] for key in common} == common
        assert asynchronous["off_policy/staleness_max"] == 0 and asynchronous["weight_sync/bytes"] > 0


def test_one_step_off_learns_within_the_staleness_bound(tmp_path: Path):
    records = run_recipe(
        "grpo", tmp_path / "k1", "trainer.total_steps=40", *SHORT, *SPLIT, "algorithm.max_staleness=1",
        "rollout.recompute_log_probs=true", nproc=4,
    )
    assert mean_reward(records[-5:]) > mean_reward(records[:5]) + 0.05
    assert [record["off_policy/batch_staleness"] for record in records] == [0.0] + [1.0] * 39
    assert all(record["off_policy/staleness_max"] <= 1 for record in records)
    # Batch 0 is on policy: engine and trainer log-probs agree to rounding (same model code, same weights).
    assert abs(records[0]["off_policy/importance_weight_max"] - 1) < 1e-5
    assert abs(records[0]["off_policy/importance_weight_min"] - 1) < 1e-5
    assert any(record["off_policy/importance_weight_max"] > 1.0 for record in records[1:])
    assert [record["rollout/policy_version"] for record in records] == [0.0] + list(map(float, range(39)))


def test_resume_takes_back_the_batches_in_flight(tmp_path: Path):
    """k = 2, 4 steps saving every 2: at step 2's checkpoint, batches 2 and 3 are in flight (versions 0 and 1).
    Resumed from it, the run's steps 2 and 3 equal the uninterrupted run's, bit for bit."""
    overrides = ("trainer.total_steps=4", "trainer.save_every=2", "trainer.val_every=0", *SPLIT,
                 "algorithm.max_staleness=2", "rollout.recompute_log_probs=true")
    whole = run_recipe("grpo", tmp_path / "whole", *overrides, nproc=4)
    checkpoint = tmp_path / "whole" / "out" / "step_2"
    assert sorted(path.name for path in (checkpoint / "rollouts").iterdir()) == ["batch_2", "batch_3"]
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "out" / "step_4")
    (tmp_path / "resumed" / "out" / "latest").write_text("step_2")
    resumed = run_recipe("grpo", tmp_path / "resumed", *overrides, nproc=4)
    assert [without_timings(record) for record in resumed] == [without_timings(record) for record in whole]
    assert [record["rollout/policy_version"] for record in whole] == [0.0, 0.0, 0.0, 1.0]
