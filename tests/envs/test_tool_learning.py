"""GRPO learns to use the calculator: a tiny model warm-started on a mix of good calls, broken calls and guesses
(``tiny.warm_start.make_tool_products_policy``) runs multi-turn GRPO on the tool_products task on 2 CPU ranks, and
both the reward and the share of trajectories whose tool call succeeds rise. On a rollout role of its own
(asynchronous RL at ``max_staleness=0``, 4 ranks) the same trajectories and updates, step for step."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from torchrun_helpers import TIMING_PREFIXES, run_recipe

from spmd_rlhf.tiny.task import make_task
from spmd_rlhf.tiny.warm_start import make_tool_products_policy

STEPS = 12


def tool_run(root: Path, model: str) -> tuple[str, ...]:
    return (
        f"model.path={model}",
        f"data.train_files=[{root}/task/train.parquet]",
        "data.val_files=[]",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "data.batch_size=8",
        "rollout.n=8",
        "rollout.environment=tool",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=32",
        "rollout.max_response_tokens=96",
        "actor.lr=5e-4",
        "actor.mini_batch_size=64",
        "actor.micro_batch_size=32",
        "reference.micro_batch_size=32",
    )


@pytest.fixture(scope="module")
def learning(tmp_path_factory) -> tuple[Path, tuple[str, ...], list[dict]]:
    """The colocated run of ``STEPS`` steps: its directory, its overrides and its metrics records."""
    root = tmp_path_factory.mktemp("tool_learning")
    model = make_tool_products_policy(str(root / "model"))
    make_task(task="tool_products", out_dir=str(root / "task"), train_size=512, val_size=8, seed=2)
    overrides = tool_run(root, model)
    return root, overrides, run_recipe("grpo", root / "run", *overrides, f"trainer.total_steps={STEPS}")


def test_grpo_learns_to_call_the_calculator(learning):
    records = learning[2]
    assert [record["step"] for record in records] == list(range(STEPS))
    rewards = [record["reward/mean"] for record in records]
    # A trajectory's call succeeded when it made one and the environment did not answer with an error.
    successes = [record["rollout/env/tool_calls/mean"] - record["rollout/env/tool_errors/mean"] for record in records]
    first, last = slice(0, 3), slice(-4, None)
    # Warm-started, over the first three steps: 0.33 of the trajectories make a call that succeeds, reward 0.28.
    assert statistics.mean(successes[first]) < 0.6 and statistics.mean(rewards[first]) < 0.45, (successes, rewards)
    # GRPO moves the policy to well-formed calls and restated products: 0.84 and 0.73 over the last four steps.
    assert statistics.mean(successes[last]) > statistics.mean(successes[first]) + 0.25, successes
    assert statistics.mean(rewards[last]) > statistics.mean(rewards[first]) + 0.25, rewards


def test_a_rollout_role_runs_the_same_trajectories(learning):
    """The rollout role (its own 2 ranks, the actor's weights synced before each batch) runs the environment's
    turns as the actor's generation does: the first two steps' metrics equal the colocated run's."""
    root, overrides, records = learning
    split = ("placement=split", "rollout.enabled=true", "rollout.n_ranks=2", "trainer.total_steps=2")
    asynchronous = run_recipe("grpo", root / "split", *overrides, *split, nproc=4)
    for synchronous, record in zip(records[:2], asynchronous, strict=True):
        common = {key: value for key, value in synchronous.items() if not key.startswith(TIMING_PREFIXES)}
        assert {key: record[key] for key in common} == common
    assert asynchronous[0]["rollout/env/tool_calls/mean"] > 0 and asynchronous[0]["weight_sync/bytes"] > 0
