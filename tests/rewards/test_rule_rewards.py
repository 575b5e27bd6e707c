"""Tests for rule rewards: registry by data source, named rules, user functions from files, bad results."""

from __future__ import annotations

import pytest

from spmd_rlhf.rewards import RuleReward


def test_auto_picks_the_rule_of_each_data_source():
    reward = RuleReward("auto")
    assert reward.score("synthetic/arithmetic", " 7", "7", {}) == (1.0, {})
    assert reward.score("synthetic/arithmetic", "8", "7", {}) == (0.1, {})
    with pytest.raises(ValueError, match="no reward rule for data_source 'gsm9k'"):
        reward.score("gsm9k", "7", "7", {})


def test_unknown_rule_names_the_choices():
    with pytest.raises(ValueError, match="reward.rule='nope' is not registered"):
        RuleReward("nope")


def test_user_function_from_a_file_with_verl_signature_and_dict_results(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(solution_str == ground_truth), 'length': len(solution_str)}\n"
        "def broken(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float('nan')\n"
    )
    assert RuleReward(f"{path}:score").score("any", "abc", "abc", {}) == (1.0, {"length": 3.0})
    with pytest.raises(ValueError, match="returned nan"):
        RuleReward(f"{path}:broken").score("any", "abc", "abc", {})
    with pytest.raises(ValueError, match="defines no function 'missing'"):
        RuleReward(f"{path}:missing")
    with pytest.raises(ValueError, match="does not exist"):
        RuleReward(f"{tmp_path}/none.py:score")
