"""RewardRunner: inline and process-pool scoring of a user file, timeouts, failures under on_error=zero and abort,
stuck and dying worker processes."""

from __future__ import annotations

import logging
import os

import pytest

from spmd_rlhf.config import ConfigError, ScoringRoleConfig
from spmd_rlhf.rewards import RewardError, RewardRow, RewardRunner, runner

USER_REWARD = """
import os, signal, time

def score(data_source, solution_str, ground_truth, extra_info):
    kind = extra_info.get("kind")
    if kind == "raise":
        raise RuntimeError("cannot read " + solution_str)
    if kind == "nan":
        return float("nan")
    if kind == "sleep":
        time.sleep(60)
    if kind == "stuck":  # like C code that never checks for signals
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    if kind == "exit":
        os._exit(3)
    return {"score": float(solution_str == ground_truth) + len(solution_str) / 100, "pid": os.getpid()}
"""


@pytest.fixture(scope="module")
def rule(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("rewards") / "user_reward.py"
    path.write_text(USER_REWARD)
    return f"{path}:score"


@pytest.fixture(scope="module")
def pool(rule):
    """One pool for the module's tests, as a role keeps one for its whole run (starting one takes a while)."""
    made = RewardRunner(rule, num_workers=2, timeout_s=1.0)
    yield made
    made.close()


def row(text: str, kind: str | None = None, answer: str = "yes") -> RewardRow:
    return RewardRow("my/source", text, answer, {"kind": kind} if kind else {})


ROWS = [row("yes"), row("no"), row("long " * 80, "raise"), row("yes", "nan"), row("maybe"), row("yes")]


def test_inline_scores_extras_and_failures(rule, caplog):
    inline = RewardRunner(rule)
    with caplog.at_level(logging.WARNING):
        outcomes = inline.score(ROWS)
    assert [outcome.failure for outcome in outcomes] == [None, None, "error", "non_finite", None, None]
    result = inline.summarize(outcomes)
    assert result.scores == [1.03, 0.02, 0.0, 0.0, 0.05, 1.03]
    assert result.extras == {"pid": [float(os.getpid())] * 4}
    assert result.failures == {"errors": 1, "timeouts": 0, "non_finite": 1}
    # Each failure is logged with the function, the row's data source, a truncated response and the cause.
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 2
    assert f"{rule} raised RuntimeError: cannot read long" in logged[0] and "data_source='my/source'" in logged[0]
    assert "long long" in logged[0] and len(logged[0]) < 650
    assert "returned nan as 'score'" in logged[1]


def test_pool_gives_the_inline_outcomes_from_other_processes_and_is_reused(rule, pool):
    inline = RewardRunner(rule).score(ROWS)
    first, second = pool.score(ROWS), pool.score(ROWS)
    without_pids = [(outcome.score, outcome.failure, outcome.message) for outcome in inline]
    assert [(outcome.score, outcome.failure, outcome.message) for outcome in first] == without_pids
    pids = {outcome.extras["pid"] for outcome in first + second if outcome.failure is None}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2  # the same two worker processes both times


def test_a_call_running_past_timeout_s_is_stopped_and_counted(pool):
    outcomes = pool.score([row("yes"), row("yes", "sleep"), row("no")])
    assert [outcome.failure for outcome in outcomes] == [None, "timeout", None]
    assert "ran longer than timeout_s=1.0" in outcomes[1].message
    assert pool.summarize(outcomes).failures == {"errors": 0, "timeouts": 1, "non_finite": 0}
    assert pool.score([row("yes")])[0].score == 1.03  # the worker that timed out still serves


def test_on_error_abort_names_the_function_the_row_and_the_cause(rule):
    aborting = RewardRunner(rule, on_error="abort")
    outcomes = aborting.score([row("yes"), row("yes", "nan"), row("oops", "raise")])
    with pytest.raises(
        RewardError,
        match=r"returned nan as 'score' \(data_source='my/source', response 'yes'\) "
        r"\(1 more of 3 rows failed too\)\. .* set reward.on_error=zero",
    ):
        aborting.summarize(outcomes)
    assert aborting.summarize(outcomes[:1]).scores == [1.03]


def test_missing_file_or_function_fails_at_start(rule, tmp_path):
    with pytest.raises(ValueError, match=f"reward.rule='{tmp_path}/gone.py:score': {tmp_path}/gone.py does not exist"):
        RewardRunner(f"{tmp_path}/gone.py:score", num_workers=2)
    with pytest.raises(ValueError, match="defines no function 'scor'"):
        RewardRunner(rule[: -len(":score")] + ":scor", num_workers=2)
    with pytest.raises(ValueError, match="reward.on_error='skip': must be one of zero, abort"):
        RewardRunner(rule, on_error="skip")


def test_a_stuck_or_dead_worker_process_is_replaced(rule, monkeypatch):
    monkeypatch.setattr(runner, "STUCK_GRACE_S", 1.0)
    pool = RewardRunner(rule, num_workers=1, timeout_s=0.2)
    try:
        stuck = pool.score([row("yes", "stuck"), row("yes")])
        assert [outcome.failure for outcome in stuck] == ["timeout", "timeout"]  # the row queued behind it too
        assert "was stopped with its worker process" in stuck[0].message
        dead = pool.score([row("yes", "exit")])
        assert dead[0].failure == "error" and "BrokenProcessPool" in dead[0].message
        assert pool.score([row("yes")])[0].score == 1.03
    finally:
        pool.close()


def test_the_config_takes_exactly_the_runners_on_error_modes():
    for mode in runner.ON_ERROR:
        assert ScoringRoleConfig(on_error=mode).on_error == mode
    with pytest.raises(ConfigError, match="on_error=skip: must be one of zero, abort"):
        ScoringRoleConfig(on_error="skip")
