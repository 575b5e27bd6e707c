"""The rollout correction reaches the actor's loss and gradient: update_actor on one batch whose engine log-probs sit
a known factor below the recomputed ones gives the loss and gradient norm of the same batch without a gap times that
factor (token, truncated, sequence and geometric weights, for every policy loss); rejection gives those of the kept
rows alone; ``preset=disabled`` leaves them unweighted. Swapping the two log-probs, or dropping the weights, fails."""

from __future__ import annotations

import json

import pytest
from torchrun_helpers import torchrun

from spmd_rlhf.tiny.model import make_tiny


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("correction")
    model_dir = make_tiny(family="qwen2", out_dir=str(root / "model"), hidden_size=32, vocab_size=300)
    finished = torchrun("correction_weights.py", model_dir, str(root), nproc=1, timeout=240, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return {path.stem: json.loads(path.read_text()) for path in root.glob("*.json")}


def assert_scaled(runs: dict[str, dict], name: str, baseline: str, factor: float) -> None:
    for key in ("actor/loss", "actor/grad_norm"):
        assert runs[name][key] == pytest.approx(factor * runs[baseline][key], rel=1e-5), (name, key)
    assert abs(runs[baseline]["actor/loss"]) > 1e-3 and runs[baseline]["actor/grad_norm"] > 1e-3


@pytest.mark.parametrize(
    ("name", "factor"),
    [("ppo_token_1.5", 1.5), ("ppo_token_3", 2.0), ("ppo_sequence_1.2", 1.2), ("ppo_geometric_1.5", 1.5)],
)
def test_importance_weights_scale_the_loss_and_gradient_by_the_computed_factor(runs, name, factor):
    assert_scaled(runs, name, "ppo_same", factor)
    assert runs[name]["off_policy/importance_weight_max"] == pytest.approx(
        {"ppo_token_3": 3.0, "ppo_geometric_1.5": 1.5, "ppo_sequence_1.2": 1.2}.get(name, 1.5), rel=1e-5
    )


@pytest.mark.parametrize("loss", ["gspo", "cispo", "gmpo", "sapo"])
def test_every_policy_loss_takes_the_weights(runs, loss):
    assert_scaled(runs, f"{loss}_token_1.5", f"{loss}_same", 1.5)


@pytest.mark.parametrize("name", ["ppo_token_rs", "ppo_seq_rs"])
def test_rejected_rows_leave_the_loss_and_its_denominator(runs, name):
    assert_scaled(runs, name, "ppo_second_half", 1.0)  # the first half's ratio 3 is outside [0.5, 2]
    assert runs[name]["off_policy/rejected_sequence_fraction"] == 0.5


def test_disabled_measures_the_gap_but_does_not_weight(runs):
    assert_scaled(runs, "ppo_disabled_3", "ppo_same", 1.0)
    assert runs["ppo_disabled_3"]["off_policy/importance_weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert runs["ppo_same"]["off_policy/log_prob_gap_mean"] == 0.0
