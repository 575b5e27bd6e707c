"""Partial rollouts in GRPO on 4 CPU ranks (actor and reference on 2, two rollout replicas beside the rule reward on
2), two steps off, each batch generated in segments of one token: a weight sync lands between segments, so responses
mix policy versions (keep_kv), every token within the staleness bound; with drop no response does. Resumed from a
checkpoint with a generation in flight (its K/V included), a run continues exactly as the uninterrupted one. The drop
run sends its weights from a background thread (rollout.background_sync)."""

from __future__ import annotations

import shutil
from pathlib import Path

from torchrun_helpers import TIMING_PREFIXES, run_recipe

TWO_STEPS_OFF = (
    "trainer.val_every=0",
    "placement=split",
    "rollout.enabled=true",
    "rollout.n_ranks=2",
    "rollout.recompute_log_probs=true",
    "algorithm.max_staleness=2",
    "rollout.partial_segment_tokens=1",
)


def without_timings(record: dict) -> dict:
    return {key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)}


def test_responses_continue_across_weight_syncs_within_the_bound_and_resume_exactly(tmp_path: Path):
    """Batch j starts (one token) at version j - 2, gets one more token after step j - 1's sync and the rest after
    step j's: a response of 4 tokens has versions [j-2, j-1, j, j]."""
    keep = (*TWO_STEPS_OFF, "trainer.total_steps=3", "trainer.save_every=2", "rollout.partial_rollouts=keep_kv")
    workdir = tmp_path / "keep_kv"
    records = run_recipe("grpo", workdir, *keep, nproc=4)
    assert [record["off_policy/batch_staleness"] for record in records] == [0.0, 1.0, 2.0]
    assert [record["off_policy/staleness_max"] for record in records] == [0.0, 1.0, 2.0]
    assert records[0]["rollout/mixed_version_responses"] == 0  # batch 0: no sync while it generated
    assert all(record["rollout/mixed_version_responses"] > 0 for record in records[1:])
    # Per token: in batch 2, a full 4-token response has staleness [2, 1, 0, 0]: mean 0.75.
    assert 0.6 < records[2]["off_policy/staleness_mean"] < 0.8

    # At step 2's checkpoint batch 2 is in flight, two segments (versions 0 and 1) generated.
    checkpoint = workdir / "out" / "step_2"
    assert sorted(path.name for path in (checkpoint / "rollouts" / "batch_2").iterdir()) == [
        "dp0_of_2_tp0_of_1.safetensors",
        "dp1_of_2_tp0_of_1.safetensors",
    ]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(workdir, resumed_dir)
    shutil.rmtree(resumed_dir / "out" / "step_3")
    (resumed_dir / "out" / "latest").write_text("step_2")
    resumed = run_recipe("grpo", resumed_dir, *keep, nproc=4)
    assert [without_timings(record) for record in resumed] == [without_timings(record) for record in records]


def test_drop_gives_single_version_responses(tmp_path: Path):
    """With the weights sent from a background thread, which changes nothing in what is generated."""
    records = run_recipe(
        "grpo",
        tmp_path / "drop",
        *TWO_STEPS_OFF,
        "trainer.total_steps=3",
        "trainer.save_every=1000",
        "rollout.partial_rollouts=drop",
        "rollout.background_sync=true",
        nproc=4,
    )
    assert [record["off_policy/batch_staleness"] for record in records] == [0.0, 1.0, 2.0]
    assert all(record["rollout/mixed_version_responses"] == 0 for record in records)
    # Only responses that ended before a sync keep an old version; the rest restarted under this step's weights.
    assert all(record["off_policy/staleness_max"] <= 2 for record in records)
    assert records[2]["off_policy/staleness_mean"] < 0.5
