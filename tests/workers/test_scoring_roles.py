"""A reward model and a critic on 2 DP ranks give the single-process model's scores and values for every row."""

from __future__ import annotations

import pytest
import torch
from torchrun_helpers import torchrun

from spmd_rlhf.models import load_model, save_pretrained
from spmd_rlhf.tiny.model import make_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("scoring")
    policy = make_tiny(family="qwen2", out_dir=str(root / "policy"), hidden_size=32, vocab_size=300)
    reward = make_tiny(
        family="llama", out_dir=str(root / "reward"), hidden_size=32, vocab_size=300, head="score", seed=1
    )
    critic = load_model(policy, head="value")
    with torch.no_grad():  # a trained-looking value head (one from a causal LM starts at zero)
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.score.bias.fill_(0.5)
    save_pretrained(critic, str(root / "critic"))
    return policy, reward, str(root / "critic")


def test_reward_model_and_critic_match_single_process(models, tmp_path):
    policy, reward, critic_dir = models
    out = tmp_path / "out.pt"
    finished = torchrun("scoring_roles.py", policy, reward, critic_dir, str(out), nproc=2, timeout=180, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    result = torch.load(out, weights_only=True)
    batch = result["batch"]
    with torch.no_grad():
        expected_scores = load_model(reward, head="score")(batch["input_ids"], attention_mask=batch["attention_mask"])
        values = load_model(critic_dir, head="value")(batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(result["scores"], expected_scores, rtol=1e-5, atol=1e-6)
    assert result["score_mean"] == pytest.approx(float(expected_scores.mean()), rel=1e-5)
    # V of the state before each response token, 0 past the response's end.
    response_length = batch["responses"].shape[1]
    expected_values = values[:, -response_length - 1 : -1] * batch["response_mask"]
    torch.testing.assert_close(result["values"], expected_values, rtol=1e-5, atol=1e-6)
    assert float(expected_values.abs().sum()) > 0
