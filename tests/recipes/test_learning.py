"""The recipes learn: default GRPO and PPO configs on the tiny model and task, run through their torchrun entry
points on 2 CPU ranks, raise the mean reward; the same seed gives the same metrics, and so does a resumed run."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from torchrun_helpers import TIMING_PREFIXES, run_recipe


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The parent of each run's directory (every run builds its own tiny/ assets, the same from the same seed)."""
    return tmp_path_factory.mktemp("recipes")


def mean_reward(records: list[dict]) -> float:
    return sum(record["reward/mean"] for record in records) / len(records)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_default_recipe_raises_the_reward(assets, name):
    records = run_recipe(name, assets / name, under_torchrun=True)  # the README's main job, as it is launched
    assert [record["step"] for record in records] == list(range(150))
    first, last = mean_reward(records[:5]), mean_reward(records[-5:])
    assert last > first + 0.08, (first, last)
    for key in (
        "reward/mean",
        "response_length/mean",
        "kl/mean",
        "time/step",
        "time/generate",
        "throughput/tokens_per_s",
    ):
        assert key in records[-1], key
    # Greedy validation on the val split every 50 steps (trainer.val_every in the default config).
    assert [record["step"] for record in records if "val/reward/mean" in record] == [49, 99, 149]
    assert 0.0 <= records[-1]["val/reward/mean"] <= 1.0
    if name == "grpo":  # its config also samples 4 responses per validation prompt
        assert 0.0 <= records[-1]["val/pass@4"] <= 1.0 and 0.0 <= records[-1]["val/sampled/reward/mean"] <= 1.0
    # What comes back to the coordinator is handles and metrics, about 2 KB a step; the rollout alone (ids, masks and
    # log-probs of 64 rows) would be over 15 KB. What it sends is mostly the prompt batch itself.
    assert max(record["coordinator/bytes_received"] for record in records) < 8_000
    assert (assets / name / "out" / "step_150" / "actor" / "model.safetensors").is_file()
    assert (assets / name / "out" / "latest").read_text() == "step_150"


def without_timings(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)} for record in records]


# An adaptive KL weight is algorithm state that a resume must restore (it moves every step). One FSDP unit per layer, as
# at real sizes: the tied vocabulary then streams from its dp shards (models/streamed_vocabulary.py), which the resume
# must restore exactly too.
SHORT_RUN = (
    "trainer.val_every=0",
    "algorithm.kl_target=0.001",
    "algorithm.kl_horizon=100",
    "actor.fsdp_unit_mb=0",
    "reference.fsdp_unit_mb=0",
)


@pytest.fixture(scope="module")
def four_steps(assets) -> list[dict]:
    profiled = ("trainer.profile_steps=[1]", "trainer.profile_trace=true")
    return run_recipe("grpo", assets / "four_steps", "trainer.total_steps=4", *profiled, *SHORT_RUN)


@pytest.fixture(scope="module")
def eight_steps(assets) -> list[dict]:
    # Validation runs after a run's last step, so it is off here: the 4-step run's would add keys to its step 3.
    return run_recipe("grpo", assets / "eight_steps", "trainer.total_steps=8", *SHORT_RUN)


def test_same_seed_same_metrics(four_steps, eight_steps):
    """Two jobs of the same seed (the second only runs longer): their first 4 steps are the same, bit for bit."""
    assert without_timings(eight_steps[:4]) == without_timings(four_steps)
    assert len({record["reward/mean"] for record in four_steps}) > 1  # the metrics do move from step to step


def test_a_profiled_step_writes_where_its_time_went(assets, four_steps):
    """trainer.profile_steps=[1]: step 1 ran under the profiler, and its table holds the ops of the roles' work on
    rank 0 (the actor's matmuls and its optimizer), which run in the controller's process; profile_trace: its
    timeline too, gzipped Chrome trace events."""
    profile = assets / "four_steps" / "out" / "profile"
    assert sorted(path.name for path in profile.iterdir()) == ["step_1.json.gz", "step_1.txt"]
    table = (profile / "step_1.txt").read_text()
    assert table.startswith("== by self host time")
    assert "aten::mm" in table or "aten::addmm" in table, table
    with gzip.open(profile / "step_1.json.gz", "rt") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert names & {"aten::mm", "aten::addmm"}


def test_resume_continues_exactly(assets, four_steps, eight_steps):
    """4 steps, save, resume, 4 more: the same per-step metrics, bit for bit, as 8 uninterrupted steps."""
    workdir = assets / "resumed"
    shutil.copytree(assets / "four_steps", workdir)  # its out/step_4, out/latest and the metrics of steps 0-3
    resumed = run_recipe("grpo", workdir, "trainer.total_steps=8", *SHORT_RUN)  # resume=auto: out/latest
    assert [record["step"] for record in resumed] == list(range(8))
    assert without_timings(resumed) == without_timings(eight_steps)
    assert len({record["kl/coef"] for record in eight_steps}) == 8  # the adaptive weight moved every step
    assert (workdir / "out" / "latest").read_text() == "step_8"
    assert not list((workdir / "out").glob("*.tmp"))


def test_grpo_at_cp_2_takes_the_steps_of_cp_1(assets, four_steps):
    """The same 4 steps with the actor at cp = 2 by ring attention and the reference at cp = 2 by Ulysses (the tiny
    model's 4 heads): the same rewards (the same responses were sampled), and losses, gradient norms, KL and entropy
    equal to float32 rounding. Each rank runs a chunk of every packed row of its cp group, its own rows' results
    gathered back to it."""
    split = ("actor.cp=2", "actor.cp_attention=ring", "reference.cp=2", "reference.cp_attention=ulysses")
    records = run_recipe("grpo", assets / "cp2", "trainer.total_steps=4", *SHORT_RUN, *split)
    assert [record["step"] for record in records] == list(range(4))
    for step, (expected, measured) in enumerate(zip(four_steps, records)):
        assert measured["reward/mean"] == expected["reward/mean"], step
        for key in ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert measured[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (step, key)
    assert "actor/cp_padding_tokens" in records[0] and "actor/cp_padding_tokens" not in four_steps[0]
