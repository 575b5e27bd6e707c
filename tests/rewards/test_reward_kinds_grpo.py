"""Each kind of reward a user brings, end to end in one GRPO step of the tiny setup on 2 CPU ranks: code executed
against a row's tests (``reward.rule=code``), a reward service (``reward.kind=remote``) and a reward model with a
tokenizer and chat template of its own. The tiny policy writes no working programs and the models are random: these
check the plumbing (what reaches each scorer, what comes back into the step's metrics), not the rewards' values.
A generative judge (``reward.kind=generative``), a tiny random causal LM of its own tokenizer and chat template,
runs the same way."""

from __future__ import annotations

import json
import math

import pytest
from test_remote_reward import computed, good, serving
from torchrun_helpers import run_recipe

from spmd_rlhf.rewards.code import OUTCOMES
from spmd_rlhf.tiny.model import make_tiny

ONE_SMALL_STEP = (
    "trainer.total_steps=1",
    "trainer.val_every=0",
    "trainer.save_every=0",
    "data.batch_size=2",
    "rollout.n=4",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=4",
    "reference.micro_batch_size=4",
)
ROWS = 8
"""data.batch_size x rollout.n responses scored in the step."""


def test_code_rows_run_against_their_tests_in_a_grpo_step(tmp_path):
    tests = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    rows = [
        {
            "data_source": "code",
            "prompt": [{"role": "user", "content": f"Add {index} numbers."}],
            "reward_model": {"style": "rule", "ground_truth": tests},
            "extra_info": {"index": index},
        }
        for index in range(4)
    ]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (record,) = run_recipe(
        "grpo",
        tmp_path,
        *ONE_SMALL_STEP,
        "data.train_files=[code.jsonl]",
        "data.val_files=[code.jsonl]",
        "reward.rule=code",  # inline: the code rule through a pool of workers is tests/rewards/test_code_reward.py's
    )
    # Every response's program met both tests, each ending in one counted outcome; none of the calls failed.
    assert sum(record[f"reward/{outcome}/mean"] for outcome in OUTCOMES) == pytest.approx(len(tests["inputs"]))
    assert record["reward/errors"] == 0 and record["reward/timeouts"] == 0
    assert record["reward/mean"] == pytest.approx(record["reward/passed/mean"] / len(tests["inputs"]))
    assert math.isfinite(record["actor/loss"])


def test_a_reward_service_scores_a_grpo_step(tmp_path):
    with serving(good) as service:
        (record,) = run_recipe("grpo", tmp_path, *ONE_SMALL_STEP, "reward.kind=remote", f"reward.url={service.url}")
    sent = [row for request in service.requests for row in request]
    assert len(sent) == ROWS
    assert all("<|im_start|>user\n" in row["prompt"] and "+" in row["prompt"] for row in sent)  # the prompt's text
    scores = [computed(row) for row in sent]
    expected = sum(score["score"] if isinstance(score, dict) else score for score in scores) / ROWS
    assert record["reward/mean"] == pytest.approx(expected)
    assert record["reward/remote_retries"] == 0 and record["reward/errors"] == 0
    assert math.isfinite(record["actor/loss"])


def test_a_reward_model_of_another_family_and_tokenizer_scores_a_grpo_step(tmp_path):
    scorer = make_tiny(
        family="llama",
        out_dir=str(tmp_path / "scorer"),
        hidden_size=32,
        head="score",
        tokenizer_tasks=("arithmetic", "tool_products"),
        chat_template="role_colon",
        seed=1,
    )
    (record,) = run_recipe("grpo", tmp_path, *ONE_SMALL_STEP, "reward.kind=model", f"reward.model_path={scorer}")
    assert math.isfinite(record["reward/mean"]) and record["reward/mean"] != 0
    assert math.isfinite(record["actor/loss"])


def test_a_generative_judge_scores_a_grpo_step(tmp_path):
    # A random judge samples random tokens, about 1 in 40 of them a digit: each verdict's last digit is its score on
    # [0, 9], and one with no digit gets the fallback -1, so the step's mean must agree with the unparsed count.
    # With 32 tokens a verdict, all 8 lacking a digit has a chance of about 0.2% (and the seed is fixed).
    judge = make_tiny(
        family="llama", out_dir=str(tmp_path / "judge"), hidden_size=32, chat_template="role_colon", seed=2
    )
    (record,) = run_recipe(
        "grpo",
        tmp_path,
        *ONE_SMALL_STEP,
        "reward.kind=generative",
        f"reward.model_path={judge}",
        "reward.judge_score_pattern=([0-9])",
        "reward.judge_score_range=[0, 9]",
        "reward.judge_fallback_score=-1",
        "reward.judge_max_new_tokens=32",
        "reward.judge_temperature=1.0",
        "reward.max_failure_fraction=1.0",
    )
    unparsed = record["reward/judge_unparsed"]
    assert unparsed == int(unparsed) and 0 <= unparsed < ROWS
    parsed_sum = record["reward/mean"] * ROWS + unparsed  # the parsed verdicts' scores, each in [0, 1]
    assert -1e-5 <= parsed_sum <= ROWS - unparsed + 1e-5
    assert 0 < record["reward/judge_tokens"] <= ROWS * 32 and record["reward/judge_seconds"] > 0
    assert math.isfinite(record["actor/loss"])
