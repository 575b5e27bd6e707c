"""Reward and cost models with a tokenizer of their own: a llama reward model of another vocabulary and chat template
scores rollouts of a qwen2 policy as ``transformers`` scores the same conversations with its own tokenizer, on 2 DP
ranks; which scorers take that path and which are refused at start."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torchrun_helpers import RECIPES, torchrun
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.controller.vocabularies import check_role_vocabularies
from spmd_rlhf.data.retokenize import TOKENIZER_FILES, foreign_tokenizer
from spmd_rlhf.tiny.model import make_tiny

ROWS = [
    [[{"role": "user", "content": "3+4="}], "7", True],
    [[{"role": "user", "content": "3+4="}], "8 is the answer", True],
    [[{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "12+5="}], "17", True],
    [[{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "12+5="}], "", True],
    ["What is 2+2?", "4", True],  # a plain-text prompt: one user message to the scorer
    ["What is 2+2?", "The quick brown fox", True],
    [[{"role": "user", "content": "1+8="}], "9 9 9 9", False],  # cut at the length limit: no EOS
    [[{"role": "user", "content": "1+8="}], "9", True],
]
"""(raw prompt, response text, ends with EOS): some chat, some plain, an empty and a truncated response."""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A qwen2 policy (ChatML, 300-token vocabulary) and a llama reward model whose tokenizer was trained on more text
    with 512 tokens and lays a chat out as "User: ..." (so the policy's ids are in its range and mean other tokens)."""
    root = tmp_path_factory.mktemp("foreign")
    policy = make_tiny(family="qwen2", out_dir=str(root / "policy"), hidden_size=32, vocab_size=300)
    scorer = make_tiny(
        family="llama",
        out_dir=str(root / "scorer"),
        hidden_size=32,
        head="score",
        tokenizer_tasks=("arithmetic", "tool_products"),
        chat_template="role_colon",
        seed=1,
    )
    return policy, scorer


def expected_scores(scorer: str) -> torch.Tensor:
    """``transformers``' scores of each row's conversation, rendered and tokenized by the scorer's own tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(scorer)
    model = AutoModelForSequenceClassification.from_pretrained(scorer, dtype=torch.float32).eval()
    scores = []
    for prompt, text, _ in ROWS:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        conversation = [*messages, {"role": "assistant", "content": text}]
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
        input_ids = torch.tensor([tokenizer(rendered, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            scores.append(model(input_ids=input_ids).logits[0, 0])
    return torch.stack(scores)


def test_a_reward_and_a_cost_model_of_another_vocabulary_and_template_score_as_transformers(models, tmp_path):
    policy, scorer = models
    policy_tokenizer, scorer_tokenizer = AutoTokenizer.from_pretrained(policy), AutoTokenizer.from_pretrained(scorer)
    assert policy_tokenizer.get_vocab() != scorer_tokenizer.get_vocab()
    assert policy_tokenizer.chat_template != scorer_tokenizer.chat_template
    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    out = tmp_path / "out.pt"
    finished = torchrun(
        "foreign_reward.py", policy, scorer, str(tmp_path / "rows.json"), str(out), nproc=2, timeout=180, forked=True
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    result = torch.load(out, weights_only=True)
    expected = expected_scores(scorer)
    torch.testing.assert_close(result["scores"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result["costs"], expected, rtol=1e-5, atol=1e-6)
    assert result["score_mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert len(set(expected.tolist())) == len(ROWS)  # every conversation scores differently: no row mixed up


def config(policy: str, *overrides: str):
    return load_config(
        str(RECIPES / "configs" / "grpo.yaml"), [f"model.path={policy}", "reward.kind=model", *overrides]
    )


def test_which_scoring_models_read_text_through_their_own_tokenizer(models, tmp_path):
    policy, scorer = models
    policy_tokenizer = AutoTokenizer.from_pretrained(policy)
    untokenized = tmp_path / "untokenized"
    shutil.copytree(scorer, untokenized)
    for file in (*TOKENIZER_FILES, "chat_template.jinja"):
        (untokenized / file).unlink(missing_ok=True)
    policy_copy = shutil.copytree(policy, tmp_path / "policy_copy")

    def reward(*overrides: str):
        return config(policy, *overrides).reward

    assert foreign_tokenizer(reward(f"reward.model_path={scorer}"), policy_tokenizer) is not None
    assert foreign_tokenizer(reward(f"reward.model_path={policy_copy}"), policy_tokenizer) is None  # the same
    assert foreign_tokenizer(reward(f"reward.model_path={untokenized}"), policy_tokenizer) is None  # none of its own
    # tokenizer_path names the tokenizer when the model directory holds none, or overrides the one it holds.
    with_path = reward(f"reward.model_path={untokenized}", f"reward.tokenizer_path={scorer}")
    assert (
        foreign_tokenizer(with_path, policy_tokenizer).get_vocab() == AutoTokenizer.from_pretrained(scorer).get_vocab()
    )
    overridden = reward(f"reward.model_path={scorer}", f"reward.tokenizer_path={policy}")
    assert foreign_tokenizer(overridden, policy_tokenizer) is None


def test_scoring_models_that_cannot_read_the_policy_or_be_rebuilt_are_refused_at_start(models, tmp_path):
    policy, scorer = models
    policy_tokenizer = AutoTokenizer.from_pretrained(policy)
    check_role_vocabularies(config(policy, f"reward.model_path={scorer}"), policy_tokenizer)  # the foreign path
    untokenized = tmp_path / "untokenized"
    shutil.copytree(scorer, untokenized)
    for file in (*TOKENIZER_FILES, "chat_template.jinja"):
        (untokenized / file).unlink(missing_ok=True)
    with pytest.raises(
        ValueError,
        match=r"reward\.model_path=\S+/untokenized holds no tokenizer, and its vocab_size=\d+ differs from the policy "
        r"model's \d+, .* set reward\.tokenizer_path to the tokenizer it was trained with",
    ):
        check_role_vocabularies(config(policy, f"reward.model_path={untokenized}"), policy_tokenizer)
    check_role_vocabularies(
        config(policy, f"reward.model_path={untokenized}", f"reward.tokenizer_path={scorer}"), policy_tokenizer
    )
    no_template = tmp_path / "no_template"
    shutil.copytree(scorer, no_template)
    settings = json.loads((no_template / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(settings))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(
        ValueError, match=r"reward: the scoring model's tokenizer \(\S+/no_template\) differs from the "
    ):
        check_role_vocabularies(config(policy, f"reward.model_path={no_template}"), policy_tokenizer)
    with pytest.raises(ValueError, match=r"rollout\.environment=tool makes multi-turn trajectories, which cannot be"):
        check_role_vocabularies(
            config(policy, f"reward.model_path={scorer}", "rollout.environment=tool"), policy_tokenizer
        )
    with pytest.raises(
        ConfigError, match=r"reward\.tokenizer_path.*only used with kind=model or generative \(kind=rule\)"
    ):
        load_config(None, ["reward.kind=rule", f"reward.tokenizer_path={scorer}"])
