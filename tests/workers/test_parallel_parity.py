"""3D-parallel parity: every role (actor, critic, reward model) under (dp, tp, pp) in {(4,1,1), (2,2,1), (1,4,1),
(2,1,2), (1,2,2)}, and hybrid-sharded (HSDP: fsdp_size 2 of dp 4, and 1 of dp 2 beside tp 2), computes the same
log-probs, values and scores as one rank, and one update leaves the same loss, gradient norm and weights. TP shards
heads, MLP and the vocabulary (log-probs without gathering the logits); PP runs 1F1B for the actor and GPipe for the
critic. Rows have different lengths and every layout feeds packed micro-batches (under PP padded to common shapes); the
critic groups its rows by a token budget, the actor by one that holds all its rows (so 1F1B splits them into one
micro-batch per stage) and the reward model by row count. FSDP's units differ by role: one per layer (actor), runs of
layers (critic), the root alone (reward model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import hf_weights, torchrun

from spmd_rlhf.tiny.model import make_tiny

LAYOUTS = [
    "dp4tp1pp1",
    "dp2tp2pp1",
    "dp1tp4pp1",
    "dp2tp1pp2",
    "dp1tp2pp2",
    "dp4tp1pp1fsdp2",
    "dp2tp2pp1fsdp1",
    "dp2tp1pp2fsdp1",
    "dp2tp2pp1sp",
    "dp1tp2pp2sp",
]
"""Three hybrid-shard (HSDP): FSDP over 2 of 4 DP ranks, two replicas; TP, or two pipeline stages, with FSDP over 1 DP
rank (each rank's shard whole), two replicas. The last two with every role's sequence parallelism, the second
through two pipeline stages."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, Path, Path]:
    """One job for both model sets: the untied llama in every layout, then the tied qwen2 in (2, 2, 1). Returns the
    untied policy's directory and each set's output directory."""
    root = tmp_path_factory.mktemp("parallel")
    # Untied embeddings (pipeline stages hold the embedding and the head apart); 4 KV heads so tp=4 splits them.
    common = dict(family="llama", hidden_size=32, num_heads=4, num_kv_heads=4, vocab_size=300, num_layers=4)
    policy = make_tiny(out_dir=str(root / "policy"), **common)
    critic = make_tiny(out_dir=str(root / "critic"), head="score", seed=1, **common)
    reward = make_tiny(out_dir=str(root / "reward"), head="score", seed=2, **common)
    tied = dict(family="qwen2", hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=300, num_layers=2)
    tied_policy = make_tiny(out_dir=str(root / "tied_policy"), **tied)
    tied_critic = make_tiny(out_dir=str(root / "tied_critic"), head="score", seed=1, **tied)
    out, tied_out = root / "out", root / "tied_out"
    out.mkdir()
    tied_out.mkdir()
    finished = torchrun(
        "parallel_parity.py",
        *(policy, critic, reward, str(out), "dp1tp1pp1", *LAYOUTS),
        *("+", tied_policy, tied_critic, tied_critic, str(tied_out), "dp1tp1pp1", "dp2tp2pp1"),
        nproc=4,
        timeout=400,
        forked=True,
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    return policy, out, tied_out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_outputs_match_one_rank(run, layout):
    _, out, _ = run
    reference, results = torch.load(out / "dp1tp1pp1.pt"), torch.load(out / f"{layout}.pt")
    for key in ("log_probs", "values", "scores"):
        torch.testing.assert_close(results[key], reference[key], rtol=1e-5, atol=1e-5, msg=f"{layout} {key}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_matches_one_rank(run, layout):
    policy, out, _ = run
    reference_metrics = json.loads((out / "dp1tp1pp1.json").read_text())
    metrics = json.loads((out / f"{layout}.json").read_text())
    for role in ("actor", "critic"):
        for rank_metrics in metrics[role]:
            for key in (f"{role}/loss", f"{role}/grad_norm"):
                assert rank_metrics[key] == pytest.approx(reference_metrics[role][0][key], rel=1e-5), (layout, key)
        reference = hf_weights(f"{out}/dp1tp1pp1_{role}")
        weights = hf_weights(f"{out}/{layout}_{role}")
        assert weights.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(
                weights[name], reference[name], rtol=1e-5, atol=2e-6, msg=f"{layout} {role} {name}"
            )
    initial = load_file(f"{policy}/model.safetensors")
    reference = hf_weights(f"{out}/dp1tp1pp1_actor")
    assert max(float((reference[name] - initial[name]).abs().max()) for name in reference) > 1e-4  # it really trained


def test_hybrid_sharding_shards_within_groups_and_replicates_across(run):
    """With fsdp_size below dp, FSDP shards each weight over its group only and replicates it across groups (HSDP's
    2-D mesh), where plain FSDP shards it over all of dp; the updates above equal one rank's either way."""
    _, out, _ = run
    layouts = {
        layout: json.loads((out / f"{layout}.json").read_text())["fsdp_layout"]
        for layout in ("dp4tp1pp1", "dp4tp1pp1fsdp2", "dp2tp2pp1fsdp1")
    }
    assert layouts["dp4tp1pp1"] == {"dims": ["dp"], "placements": ["Shard(dim=0)"], "local_fraction": 0.25}
    assert layouts["dp4tp1pp1fsdp2"] == {
        "dims": ["dp_replicate", "dp_shard"],
        "placements": ["Replicate()", "Shard(dim=0)"],
        "local_fraction": 0.5,
    }
    assert layouts["dp2tp2pp1fsdp1"] == {  # the down projection's TP split is over its columns
        "dims": ["dp_replicate", "dp_shard", "tp"],
        "placements": ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"],
        "local_fraction": 0.5,
    }


def test_checkpoint_resumes_into_another_layout(run):
    """Saved by (dp, tp, pp) = (2, 2, 1) as HSDP (two replicas of each rank's unsharded TP shard), loaded by
    (1, 2, 2): the weights arrive bitwise, and the next update (restored optimizer moments and schedule) matches the
    uninterrupted actor's."""
    _, out, _ = run
    saved, resumed = hf_weights(f"{out}/dp2tp2pp1fsdp1_actor"), hf_weights(f"{out}/resumed_actor")
    assert all(saved[name].equal(resumed[name]) for name in saved)
    metrics = json.loads((out / "resume.json").read_text())
    for key in ("actor/loss", "actor/grad_norm", "actor/lr"):
        assert metrics["resumed"][0][key] == pytest.approx(metrics["saved"][0][key], rel=1e-5), key
    saved, resumed = hf_weights(f"{out}/saved_next"), hf_weights(f"{out}/resumed_next")
    for name in saved:
        torch.testing.assert_close(resumed[name], saved[name], rtol=1e-5, atol=2e-6, msg=name)


def test_tied_embeddings_under_tensor_parallelism(run):
    """A model that ties its embedding and LM head (Qwen2.5-0.5B-style) stays tied when both are vocab-sharded."""
    _, _, out = run
    reference, results = torch.load(out / "dp1tp1pp1.pt"), torch.load(out / "dp2tp2pp1.pt")
    torch.testing.assert_close(results["log_probs"], reference["log_probs"], rtol=1e-5, atol=1e-5)
    reference = hf_weights(f"{out}/dp1tp1pp1_actor")
    weights = hf_weights(f"{out}/dp2tp2pp1_actor")
    assert "lm_head.weight" not in weights  # still tied: saved once, as the embedding
    # Two Adam steps at lr 1e-3: an embedding row whose gradient is near Adam's eps (1e-8) moves by
    # lr * g / (|g| + eps), whose slope lr * eps / (|g| + eps)^2 turns float32 summation-order noise of the
    # vocab-sharded
    # gradient into up to a few 1e-6 (measured 2.2e-6 on one element of 9,600 since packed micro-batches).
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-5, atol=4e-6, msg=name)
