"""Data-parallel parity: update_actor with dp=2 and dp=4, with 4x larger micro-batches, or with token-balanced
micro-batches (dp=2 ranks agreeing on their count), with the model one FSDP unit or one unit per layer (each
gathered and its gradient reduce-scattered once per mini-batch, or in every micro-batch), leaves the same weights,
loss and gradient norm as dp=1 on the same batch (two PPO epochs, gradient accumulation, KL and entropy terms), for
token- and sequence-level aggregation; compute_log_probs gives the same log-probs in the batch's row order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import torchrun

from spmd_rlhf.tiny.model import make_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(
        family="qwen2", out_dir=str(tmp_path_factory.mktemp("tiny") / "model"), hidden_size=32, vocab_size=300
    )


AGGREGATIONS = ["token_mean", "seq_mean_token_mean"]


@pytest.fixture(scope="module")
def out(model_dir, tmp_path_factory) -> Path:
    """One job for every aggregation; each one's results in ``out / aggregation``."""
    out = tmp_path_factory.mktemp("dp_parity")
    finished = torchrun("dp_parity.py", model_dir, str(out), *AGGREGATIONS, nproc=4, timeout=300, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return out


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_update_actor_is_independent_of_dp_size(model_dir, out, aggregation):
    results = out / aggregation
    initial = load_file(f"{model_dir}/model.safetensors")
    reference = load_file(f"{results}/dp1/model.safetensors")
    moved = max(float((reference[name] - initial[name]).abs().max()) for name in reference)
    assert moved > 1e-4  # the update really changed the weights
    reference_metrics = json.loads((results / "dp1.json").read_text())[0]
    runs = ("dp2", "dp4", "dp1_micro8", "dp2_tokens11", "dp1_tokens30")
    for run in (*runs, "dp2_unit_per_layer", "dp2_unit_per_layer_per_micro_batch"):
        for rank_metrics in json.loads((results / f"{run}.json").read_text()):
            # Global quantities: the same on every rank and for every DP size.
            for key in ("actor/grad_norm", "actor/loss"):
                assert rank_metrics[key] == pytest.approx(reference_metrics[key], rel=1e-5), (run, key)
        log_probs = torch.load(results / f"{run}_log_probs.pt")
        torch.testing.assert_close(log_probs, torch.load(results / "dp1_log_probs.pt"), rtol=1e-5, atol=1e-6, msg=run)
        weights = load_file(f"{results}/{run}/model.safetensors")
        assert weights.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(weights[name], reference[name], rtol=1e-5, atol=1e-6, msg=f"{run} {name}")
