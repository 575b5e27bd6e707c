"""A tiny Qwen3-MoE actor trained FSDP-sharded over 2 CPU ranks generates at rollout.tp = 1: the HybridEngine's
generation copy holds every expert tensor whole and equal to the checkpoint, and the rollout log-probs equal the
training forward's (float32, 1e-6), as the actor's ``rollout/log_prob_diff_max`` reports
(``programs/moe_rollout.py``)."""

from __future__ import annotations

import json

import pytest
from torchrun_helpers import torchrun

from spmd_rlhf.tiny.model import make_tiny


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rollout")
    policy = make_tiny(family="qwen3_moe", out_dir=str(root / "policy"), hidden_size=32, vocab_size=300)
    finished = torchrun("moe_rollout.py", policy, str(root), nproc=2, timeout=300)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return json.loads((root / "results.json").read_text())


def test_the_generation_copy_holds_the_experts_whole(results):
    copy = results["generation_copy"]
    assert copy["max_difference"] == 0.0
    assert "model.layers.0.mlp.experts.gate_proj" in copy["expert_tensors"]


def test_rollout_log_probs_equal_training_log_probs(results):
    assert results["tokens"] > 0
    assert results["max_difference"] <= 1e-6
    assert results["metric"] == pytest.approx(results["max_difference"], abs=1e-12)
