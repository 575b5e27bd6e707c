"""Context parallelism with a mixture-of-experts actor (``programs/moe_context_parallel.py``: a tiny Qwen3-MoE, 4
experts, top 2, on 2 CPU ranks): Ulysses, ring and Ulysses with the experts split over the same ranks (ep = 2) equal
the same data-parallel ranks without cp. The routers' losses are the whole micro-batch's (their terms all-reduced
over the group, the padding that makes rows divisible excluded); replayed experts reach each rank's chunk at its
positions; recorded experts come back whole, in row order."""

from __future__ import annotations

import json

import pytest
import torch
from torchrun_helpers import hf_weights, torchrun

from spmd_rlhf.tiny.model import make_tiny

REFERENCE = "dp2cp1"
LAYOUTS = ["dp2cp2", "dp2cp2ring", "dp2cp2ep2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_context_parallel")
    policy = make_tiny(
        family="qwen3_moe", out_dir=str(root / "policy"), hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=300
    )
    out = root / "out"
    out.mkdir()
    finished = torchrun(
        "moe_context_parallel.py", policy, str(out), REFERENCE, *LAYOUTS, nproc=2, timeout=300, forked=True
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    return out


def test_replay_changes_the_reference_log_probs(run):
    """The random recorded experts are not the routers' own: replaying them must show."""
    reference = torch.load(run / f"{REFERENCE}.pt")
    assert (reference["replayed"] - reference["own"]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_log_probs_with_and_without_replay_match(run, layout):
    reference, results = torch.load(run / f"{REFERENCE}.pt"), torch.load(run / f"{layout}.pt")
    for key in ("own", "replayed"):
        torch.testing.assert_close(results[key], reference[key], rtol=1e-5, atol=1e-5, msg=f"{layout} {key}")


@pytest.mark.parametrize("layout", ["dp2cp2ring"])
def test_recorded_experts_come_back_whole_in_row_order(run, layout):
    reference, results = torch.load(run / f"{REFERENCE}.pt"), torch.load(run / f"{layout}.pt")
    assert results["recorded"].dtype == torch.int8
    assert (reference["recorded"] >= 0).sum() > 0
    assert torch.equal(results["recorded"], reference["recorded"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_gradient_of_the_replayed_log_probs_matches(run, layout):
    reference, gradients = torch.load(run / f"{REFERENCE}_gradients.pt"), torch.load(run / f"{layout}_gradients.pt")
    assert gradients.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(gradients[name], reference[name], rtol=1e-5, atol=5e-6, msg=f"{layout} {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_updates_with_router_losses_match(run, layout):
    reference_metrics = json.loads((run / f"{REFERENCE}.json").read_text())
    metrics = json.loads((run / f"{layout}.json").read_text())
    keys = ("loss", "grad_norm", "router_aux_loss", "router_z_loss", "expert_load_max_over_mean")
    for step, (expected, measured) in enumerate(zip(reference_metrics, metrics)):
        for rank, (ours, theirs) in enumerate(zip(measured, expected)):  # each DP rank's own micro-batches
            assert theirs["actor/router_aux_loss"] > 0.5 and theirs["actor/router_z_loss"] > 0
            for key in keys:
                assert ours[f"actor/{key}"] == pytest.approx(theirs[f"actor/{key}"], rel=1e-5), (
                    layout,
                    step,
                    rank,
                    key,
                )
    reference, weights = hf_weights(f"{run}/{REFERENCE}_actor"), hf_weights(f"{run}/{layout}_actor")
    assert weights.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-5, atol=5e-6, msg=f"{layout} {name}")
