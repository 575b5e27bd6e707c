"""Multi-turn GRPO through the recipe on 2 CPU ranks, one tensor-parallel generation replica: trajectories of several
turns reach the actor's update, the engine's log-probs equal the training forward's on them, later turns reuse earlier
turns' KV blocks, environment rewards reach the scores, and a resumed run repeats a step exactly."""

from __future__ import annotations

from pathlib import Path

from torchrun_helpers import TIMING_PREFIXES, run_recipe

from spmd_rlhf.tiny.model import make_tiny, raise_eos_logit
from spmd_rlhf.tiny.task import make_task

PROGRAMS = Path(__file__).parent / "programs"


def without_timings(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if not key.startswith(TIMING_PREFIXES)} for record in records]


def test_multi_turn_grpo_steps_and_exact_resume(tmp_path):
    model = make_tiny(family="llama", out_dir=str(tmp_path / "model"))
    raise_eos_logit(model)  # a random-init policy then ends turns after a few tokens
    make_task(task="tool_products", out_dir=str(tmp_path / "task"), train_size=64, val_size=8)
    common = (
        f"model.path={model}",
        f"data.train_files=[{tmp_path}/task/train.parquet]",
        "data.val_files=[]",
        "trainer.val_every=0",
        "trainer.total_steps=2",
        "trainer.save_every=1",
        "data.batch_size=4",
        "rollout.n=4",
        "rollout.max_new_tokens=12",
        "rollout.max_turns=3",
        "rollout.max_response_tokens=48",
        "rollout.recompute_log_probs=true",
        "rollout.kv_block_size=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=8",
        "reference.micro_batch_size=8",
        "actor.tp=2",
        "rollout.tp=2",
        f"rollout.environment={PROGRAMS}/always_observe.py:AlwaysObserve",
    )
    records = run_recipe("grpo", tmp_path / "run", *common)
    assert [record["step"] for record in records] == [0, 1]
    for record in records:
        assert record["rollout/turns/mean"] > 1.0, record  # some trajectories had several turns
        assert record["rollout/observation_tokens"] > 0 and record["rollout/cached_prefill_tokens"] > 0
        assert record["rollout/log_prob_diff_max"] <= 1e-5, record
        # 0.25 per turn from the environment on top of the rule's score.
        assert record["rollout/env_reward/mean"] == 0.25 * record["rollout/turns/mean"]
    # Resumed from the checkpoint after step 0, step 1 samples the same trajectories and gets the same metrics.
    resumed = run_recipe("grpo", tmp_path / "resumed", *common, f"trainer.resume={tmp_path}/run/out/step_1")
    assert without_timings(resumed)[-1] == without_timings(records)[-1]
