"""Tests for rule rewards: registry by data source, named rules and their kwargs, user functions from files, bad
results."""

from __future__ import annotations

import pytest

from spmd_rlhf.rewards import NonFiniteReward, RuleReward
from spmd_rlhf.rewards.synthetic import cost_arithmetic


def test_auto_picks_the_rule_of_each_data_source():
    reward = RuleReward("auto")
    assert reward.score("synthetic/arithmetic", " 7", "7", {}) == (1.0, {})
    assert reward.score("synthetic/arithmetic", "8", "7", {}) == (0.1, {})
    for response in ("7", "seven"):
        assert reward.score("synthetic/arithmetic_cost", response, "7", {}) == (cost_arithmetic(response), {})
    assert reward.score("openai/gsm8k", "#### 1,000", "1000", {}) == (1.0, {})
    assert reward.score("HuggingFaceH4/MATH-500", "\\boxed{\\dfrac12}", "0.5", {}) == (1.0, {})
    with pytest.raises(ValueError, match="no reward rule for data_source 'gsm9k'"):
        reward.score("gsm9k", "7", "7", {})


def test_unknown_rule_names_the_choices():
    with pytest.raises(ValueError, match="reward.rule='nope' is not registered"):
        RuleReward("nope")
    with pytest.raises(ValueError, match="cost.rule='nope' is not registered"):
        RuleReward("nope", name="cost")


def test_rule_kwargs_reach_the_function_and_are_checked_at_start():
    assert RuleReward("gsm8k").score("gsm8k", "it is 5", "7", {})[0] == 0.0
    assert RuleReward("gsm8k", {"format_score": 0.1}).score("gsm8k", "it is 5", "7", {})[0] == 0.1
    assert RuleReward("gsm8k", {"strict": True, "format_score": 0.1}).score("gsm8k", "it is 5", "7", {})[0] == 0.0
    with pytest.raises(ValueError, match=r"reward.rule_kwargs: math does not take \['strict'\]"):
        RuleReward("math", {"strict": True})


def test_user_function_from_a_file_with_verl_signature_and_dict_results(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(solution_str == ground_truth), 'length': len(solution_str), 'pred': solution_str}\n"
        "def broken(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': 1.0, 'length': float('inf')}\n"
        "def no_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'acc': 1.0}\n"
    )
    # Non-numeric entries (verl's math_dapo returns the predicted answer as 'pred') are not metrics.
    assert RuleReward(f"{path}:score").score("any", "abc", "abc", {}) == (1.0, {"length": 3.0})
    with pytest.raises(NonFiniteReward, match="returned inf as 'length'"):
        RuleReward(f"{path}:broken").score("any", "abc", "abc", {})
    with pytest.raises(ValueError, match="without a 'score' key"):
        RuleReward(f"{path}:no_score").score("any", "abc", "abc", {})
    with pytest.raises(ValueError, match="defines no function 'missing'"):
        RuleReward(f"{path}:missing")
    with pytest.raises(ValueError, match="none.py does not exist"):
        RuleReward(f"{tmp_path}/none.py:score")
    with pytest.raises(ValueError, match="is written path/to/file.py:function"):
        RuleReward(str(path))


def test_a_relative_file_path_is_kept_absolute_for_worker_processes(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n")
    monkeypatch.chdir(tmp_path)
    assert RuleReward("mine.py:score").rule == f"{tmp_path.resolve()}/mine.py:score"


def test_correctness_plus_format_in_a_user_file_as_documented(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "from spmd_rlhf.rewards import math_score, think_answer_format\n\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    correct = math_score(data_source, solution_str, ground_truth, extra_info)\n"
        "    layout = think_answer_format(data_source, solution_str, ground_truth, extra_info)\n"
        "    return {'score': correct + 0.1 * layout, 'correct': correct, 'format': layout}\n"
    )
    reward = RuleReward(f"{path}:score")
    for response, correct, layout in [
        ("<think>half</think> \\boxed{0.5}", 1.0, 1.0),
        ("\\boxed{0.5}", 1.0, 0.0),
        ("<think>half</think> \\boxed{2}", 0.0, 1.0),
    ]:
        expected = (correct + 0.1 * layout, {"correct": correct, "format": layout})
        assert reward.score("math", response, "\\frac12", {}) == expected
