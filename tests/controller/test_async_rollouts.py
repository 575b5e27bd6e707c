"""The asynchronous rollout schedule (``controller.rollout_pipeline``) keeps every batch within the staleness bound, and
asynchronous configs are checked at load, and in-flight batches saved for another staleness are refused on resume."""

from __future__ import annotations

import json
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


class Done:
    """A call that has completed with ``value``."""

    def __init__(self, value) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None):
        return self.value


class Roles:
    """The actor, rollout and reward as the pipeline calls them, each call answered at once; rows are
    ``("rows", batch, greedy)`` and their scores ``("scores", rows)``."""

    def __init__(self) -> None:
        self.generated: list[tuple[int, bool]] = []

    def send_weights(self, version: int) -> Done:
        return Done({"weight_sync/bytes": 1.0})

    def receive_weights(self, version: int) -> Done:
        return Done(None)

    def generate_sequences(self, prompts: int, *, greedy: bool = False) -> Done:
        self.generated.append((prompts, greedy))
        return Done(("rows", prompts, greedy))

    def compute_rewards(self, rows: Done) -> Done:
        return Done(("scores", rows.result()))

    def save_rows(self, rows: Done, directory: str) -> Done:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "rows.json").write_text(json.dumps(rows.result()))
        return Done(None)

    def restore_rows(self, prompts: int, directory: str) -> Done:
        return Done(tuple(json.loads((Path(directory) / "rows.json").read_text())))


class Batches:
    def batch(self, index: int) -> int:
        return index


def test_remax_greedy_baseline_goes_with_its_batch_through_a_checkpoint(tmp_path):
    """ReMax on a rollout role: each batch's greedy responses are generated right behind it (the same policy
    version) and scored; a checkpoint with batches in flight keeps them, and the resumed pipeline hands each step the
    baseline of its own prompts."""
    from spmd_rlhf.controller.rollout_pipeline import RolloutPipeline
    from spmd_rlhf.metrics.step_metrics import StageTimer

    def pipeline(roles: Roles, start: int) -> RolloutPipeline:
        options = dict(actor=roles, rollout=roles, reward=roles, loader=Batches(), max_staleness=1, total_steps=4)
        return RolloutPipeline(**options, start=start, timeout_s=5.0, greedy_baseline=True)

    roles = Roles()
    first = pipeline(roles, start=0)
    for step in range(2):
        rollout, scores, _ = first.take(step, StageTimer())
        assert rollout == ("rows", step, False) and scores.result() == ("scores", rollout)
        assert first.baseline(step).result() == ("scores", ("rows", step, True))
    assert roles.generated == [(0, False), (0, True), (1, False), (1, True), (2, False), (2, True)]
    state = first.save(str(tmp_path))  # batch 2 in flight, with its greedy responses
    resumed = pipeline(Roles(), start=2)
    resumed.restore(str(tmp_path), state)
    rollout, _, _ = resumed.take(2, StageTimer())
    assert rollout == ("rows", 2, False)
    assert resumed.baseline(2).result() == ("scores", ("rows", 2, True))
