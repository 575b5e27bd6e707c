"""The recipes learn: default GRPO and PPO configs on the tiny model and task, run through their torchrun entry
points on 2 CPU ranks, raise the mean reward; the same seed gives the same metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_helpers import torchrun

RECIPES = Path(__file__).parents[2] / "recipes"
TIMING_PREFIXES = ("time/", "throughput/", "coordinator/")


def run_recipe(name: str, workdir: Path, *overrides: str) -> list[dict]:
    """Run recipes/<name>.py with its default config in ``workdir`` (tiny assets are built there on first use)."""
    workdir.mkdir(parents=True, exist_ok=True)
    finished = torchrun(
        str(RECIPES / f"{name}.py"), "--config", str(RECIPES / "configs" / f"{name}.yaml"), "trainer.output_dir=out",
        *overrides, nproc=2, timeout=300, cwd=str(workdir),
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    return [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The parent of each run's directory (every run builds its own tiny/ assets, the same from the same seed)."""
    return tmp_path_factory.mktemp("recipes")


def mean_reward(records: list[dict]) -> float:
    return sum(record["reward/mean"] for record in records) / len(records)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_default_recipe_raises_the_reward(assets, name):
    records = run_recipe(name, assets / name)
    assert [record["step"] for record in records] == list(range(150))
    first, last = mean_reward(records[:5]), mean_reward(records[-5:])
    assert last > first + 0.08, (first, last)
    for key in ("reward/mean", "response_length/mean", "kl/mean", "time/step", "time/generate", "throughput/tokens_per_s"):
        assert key in records[-1], key
    # Greedy validation on the val split every 50 steps (trainer.val_every in the default config).
    assert [record["step"] for record in records if "val/reward/mean" in record] == [49, 99, 149]
    assert 0.0 <= records[-1]["val/reward/mean"] <= 1.0
    # What comes back to the coordinator is handles and metrics, about 2 KB a step; the rollout alone (ids, masks and
    # log-probs of 64 rows) would be over 15 KB. What it sends is mostly the prompt batch itself.
    assert max(record["coordinator/bytes_received"] for record in records) < 8_000
    assert (assets / name / "out" / "step_150" / "actor" / "model.safetensors").is_file()
    assert (assets / name / "out" / "latest").read_text() == "step_150"


def without_timings(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)} for record in records]


@pytest.fixture(scope="module")
def four_steps(assets) -> list[dict]:
    return run_recipe("grpo", assets / "four_steps", "trainer.total_steps=4", "trainer.val_every=0")


def test_same_seed_same_metrics(assets, four_steps):
    again = run_recipe("grpo", assets / "four_steps_again", "trainer.total_steps=4", "trainer.val_every=0")
    assert without_timings(again) == without_timings(four_steps)
    assert len({record["reward/mean"] for record in four_steps}) > 1  # the metrics do move from step to step


def test_resume_continues_exactly(assets, four_steps):
    workdir = assets / "resumed"
    # Validation runs after a run's last step, so it is off here: the 2-step run's would add keys to its step 1.
    run_recipe("grpo", workdir, "trainer.total_steps=2", "trainer.val_every=0")
    resumed = run_recipe("grpo", workdir, "trainer.total_steps=4", "trainer.val_every=0")  # resume=auto: out/latest
    assert [record["step"] for record in resumed] == [0, 1, 2, 3]
    assert without_timings(resumed) == without_timings(four_steps)
    assert (workdir / "out" / "latest").read_text() == "step_4"
    assert not (workdir / "out" / "step_4.tmp").exists()
