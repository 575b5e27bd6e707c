"""GRPO learns to use the calculator: a tiny model warm-started on a mix of good calls, broken calls and guesses
(``tiny.warm_start.make_tool_products_policy``) runs multi-turn GRPO on the tool_products task on 2 CPU ranks, and
both the reward and the share of trajectories whose tool call succeeds rise."""

from __future__ import annotations

import statistics

from torchrun_helpers import run_recipe

from spmd_rlhf.tiny.task import make_task
from spmd_rlhf.tiny.warm_start import make_tool_products_policy

STEPS = 12


def test_grpo_learns_to_call_the_calculator(tmp_path):
    model = make_tool_products_policy(str(tmp_path / "model"))
    make_task(task="tool_products", out_dir=str(tmp_path / "task"), train_size=512, val_size=8, seed=2)
    records = run_recipe(
        "grpo",
        tmp_path / "run",
        f"model.path={model}",
        f"data.train_files=[{tmp_path}/task/train.parquet]",
        "data.val_files=[]",
        "trainer.val_every=0",
        f"trainer.total_steps={STEPS}",
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
