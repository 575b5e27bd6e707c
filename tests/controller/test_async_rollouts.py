"""The asynchronous rollout schedule (``controller.rollout_pipeline``) keeps every batch within the staleness bound, and
asynchronous configs are checked at load, and in-flight batches saved for another staleness are refused on resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.controller.rollout_pipeline import generation_version

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "grpo.yaml"
ASYNC = ["placement=split", "rollout.enabled=true", "rollout.n_ranks=2"]


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 5])
@pytest.mark.parametrize("start", [0, 3])
def test_every_batch_is_within_the_bound_and_issued_at_its_own_version(max_staleness, start):
    for batch in range(start, start + 30):
        version = generation_version(batch, max_staleness, start)
        assert 0 <= batch - version <= max_staleness
        # The pipeline issues batch j once step j - k starts (all of the first k + 1 at the start), when the actor
        # holds exactly this version: it never needs a policy newer than the one it is issued under.
        issued_at = max(start, batch - max_staleness)
        assert version == issued_at
    if max_staleness == 0:
        assert [generation_version(b, 0, start) for b in range(start, start + 5)] == list(range(start, start + 5))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.max_staleness=1", "rollout.enabled=false"], "set rollout.enabled=true"),
        (
            [*ASYNC, "algorithm.max_staleness=1", "rollout.recompute_log_probs=false"],
            "set rollout.recompute_log_probs=",
        ),
        (["rollout.enabled=true", "placement=colocate"], "use placement=split"),
        (["rollout.background_sync=true"], "needs rollout.enabled=true"),
        ([*ASYNC, "algorithm.dynamic_sampling=true"], "set it false with rollout.enabled=true"),
        ([*ASYNC, "algorithm.correction.is_level=clip"], r"algorithm\.correction\.is_level=clip: must be token"),
        ([*ASYNC, "algorithm.correction.is_threshold=1.0"], "must be > 1"),
        (["algorithm.correction.preset=pg_rs"], "policy-gradient loss without clipping"),
        (
            ["algorithm.correction.preset=decoupled_geo_rs", "algorithm.correction.rs_threshold=3"],
            r"algorithm\.correction\.rs_threshold=3(\.0)?: preset decoupled_geo_rs sets it to 1\.001",
        ),
        ([*ASYNC, "actor.lora.rank=4", "reference.enabled=false"], "not LoRA adapters merged into them"),
        (["algorithm.name=remax", "rollout.n=1", "critic.enabled=false", *ASYNC], "never calls the rollout"),
    ],
)
def test_asynchronous_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, overrides)


def test_split_places_the_rollout_beside_the_scorers():
    from spmd_rlhf.mapping.role_pools import place_roles

    config = load_config(GRPO, [*ASYNC, "algorithm.max_staleness=2", "rollout.recompute_log_probs=true"])
    roles = place_roles(config, 4).roles
    assert roles["actor"][0].ranks == roles["reference"][0].ranks == (0, 1)
    assert roles["rollout"][0].ranks == roles["reward"][0].ranks == (2, 3)
    assert roles["rollout"][1].dp == 2  # two replicas of rollout.tp=1


def test_a_checkpoint_in_flight_for_another_staleness_is_refused_naming_the_key():
    from spmd_rlhf.controller.rollout_pipeline import RolloutPipeline

    pipeline = RolloutPipeline(
        actor=None, rollout=None, reward=None, loader=None, max_staleness=1, total_steps=10, start=4, timeout_s=1.0
    )
    with pytest.raises(ValueError, match="resume it with that value"):
        pipeline.restore("out/step_4", {"max_staleness": 2, "pending": {"4": 2, "5": 3}})


def test_a_checkpoint_in_flight_for_another_partial_rollouts_mode_is_refused_naming_the_key():
    from spmd_rlhf.controller.rollout_pipeline import RolloutPipeline

    pipeline = RolloutPipeline(
        actor=None,
        rollout=None,
        reward=None,
        loader=None,
        max_staleness=2,
        total_steps=10,
        start=4,
        timeout_s=1.0,
        partial_rollouts="drop",
    )
    with pytest.raises(ValueError, match="rollout.partial_rollouts=keep_kv; resume it with that value"):
        pipeline.restore("out/step_4", {"max_staleness": 2, "partial_rollouts": "keep_kv", "pending": {"4": 2}})
    with pytest.raises(ValueError, match="rollout.partial_rollouts=off; resume it with that value"):
        pipeline.restore("out/step_4", {"max_staleness": 2, "pending": {"4": 2}})  # saved before partial rollouts
