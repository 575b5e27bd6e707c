"""A tiny Qwen3-MoE actor trained FSDP-sharded over 2 CPU ranks generates at rollout.tp = 1
(``programs/moe_rollout.py``): the HybridEngine's generation copy holds every expert tensor whole and equal to the
checkpoint; the rollout log-probs equal the training forward's (float32, 1e-6), as the actor's
``rollout/log_prob_diff_max`` reports, with router replay off and on; when the generation copy's routers pick from
noisy probabilities (routing flips between engine and trainer), the log-probs differ without replay and are equal
again with the engine's experts replayed (R3); R2's recorded experts, replayed, give back the old log-probs. Each
mode's ``rollout/log_prob_diff_max`` is printed by the program. With the experts split over the two ranks
(``actor.ep=2``) the generation copy still holds them whole, the log-probs still agree, and replay still closes the
gap; with each expert's width split over ``actor.tp=2``, generating at ``rollout.tp=1`` (the copy joins the halves)
and at ``rollout.tp=2`` (the engine runs tensor-parallel experts), the copy equals the checkpoint and the log-probs
agree."""

from __future__ import annotations

import json

import pytest
from torchrun_helpers import torchrun

from spmd_rlhf.tiny.model import make_tiny

MODES = ("off", "rollout", "recompute")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rollout")
    policy = make_tiny(family="qwen3_moe", out_dir=str(root / "policy"), hidden_size=32, vocab_size=300)
    finished = torchrun("moe_rollout.py", policy, str(root), nproc=2, timeout=400, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("ep", ["", "ep2/", "tp2/", "tp2g2/"])
def test_the_generation_copy_holds_the_experts_whole(results, ep):
    copy = results[f"{ep}off:0.0"]["generation_copy"]
    assert copy["max_difference"] == 0.0
    assert "model.layers.0.mlp.experts.gate_proj" in copy["expert_tensors"]


@pytest.mark.parametrize("mode", [*MODES, "ep2/off", "tp2/off", "tp2g2/off"])
def test_rollout_log_probs_equal_training_log_probs(results, mode):
    case = results[f"{mode}:0.0"]
    assert case["tokens"] > 0 and case["updated"]
    assert case["max_difference"] <= 1e-6
    assert case["metric"] == pytest.approx(case["max_difference"], abs=1e-12)


def test_the_routes_travel_compactly_with_the_rows(results):
    assert results["off:0.0"]["routes"] is None
    for mode in ("rollout", "recompute"):
        routes = results[f"{mode}:0.0"]["routes"]
        # 8 prompts x 2 samples, 6 prompt + 8 response positions, 2 MoE layers, top-2; 4 experts fit int8.
        assert routes == {"dtype": "torch.int8", "shape": [16, 14, 2, 2]}


@pytest.mark.parametrize("ep", ["", "ep2/"])
def test_replaying_the_engine_experts_closes_the_gap_that_flipped_routing_opens(results, ep):
    off, replayed = results["off:0.05"], results[f"{ep}rollout:0.05"]
    assert off["max_difference"] > 1e-3, off  # the noisy picks flip routes: the engine and the trainer disagree
    assert replayed["max_difference"] <= 1e-6, replayed  # replayed, the trainer routes as the engine did
    assert replayed["metric"] == pytest.approx(replayed["max_difference"], abs=1e-12)


def test_replaying_the_recomputed_experts_gives_back_the_old_log_probs(results):
    for perturbation in ("0.0", "0.05"):
        assert results[f"recompute:{perturbation}"]["replayed_recompute_difference"] <= 1e-6
