import pytest
import torch

from spmd_rlhf.algos import broadcast_to_tokens, gae, group_advantages, scores_to_token_rewards, whiten


def test_gae_matches_hand_computation():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # δ2 = 1 - 0.7 = 0.3; δ1 = 0.9*0.7 - 0.6 = 0.03, A1 = 0.03 + 0.45*0.3; δ0 = 0.9*0.6 - 0.5, A0 = 0.04 + 0.45*A1
    torch.testing.assert_close(advantages, torch.tensor([[0.11425, 0.165, 0.3]]))
    torch.testing.assert_close(returns, torch.tensor([[0.61425, 0.765, 1.0]]))


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    advantages, returns = gae(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lam=1.0
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))


def test_gae_skips_masked_positions():
    # Padding after the response: values there are ignored.
    advantages, _ = gae(
        torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.6, 9.0]]), torch.tensor([[1, 1, 0]]), gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.22, 0.4, 0.0]]))
    # A masked token in the middle (e.g. a tool output) is skipped: t=0 bootstraps from t=2.
    advantages, _ = gae(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.7]]), torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.265, 0.0, 0.3]]))


def test_group_advantages_with_and_without_std():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25, unbiased std 0.5
    torch.testing.assert_close(group_advantages(scores, 4), torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        group_advantages(scores, 4, normalize_std=False), torch.tensor([0.75, -0.25, -0.25, -0.25])
    )
    pairs = group_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0]), 2)
    torch.testing.assert_close(pairs, torch.tensor([-0.70710678, 0.70710678, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert torch.equal(group_advantages(torch.tensor([2.0, 7.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_scores_land_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask).tolist() == [[2, 2, 0], [-1, 0, 0], [0, 0, 0]]


def test_whiten_over_masked_entries():
    values = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(whiten(values, mask), torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        whiten(values, mask, shift_mean=False), torch.tensor([[1.0, 3.0, 0.0]]), atol=1e-4, rtol=0
    )
