"""Expert parallelism in a trained role (``programs/expert_parallel_parity.py``): a tiny Qwen3-MoE actor with
``actor.ep`` in {2, 4} over 2, 4 or 8 CPU ranks, with the experts also FSDP-sharded (dp4·ep2), through a pipeline
(dp2·ep2·pp2), with tensor parallelism (dp2·ep2·tp2, with and without sequence parallelism, and dp4·ep4·tp2 over 8
ranks; TP alone: tests/models/test_moe.py) and with HSDP (dp4·ep2, fsdp_size 2), computes the same log-probs as one
rank, and two updates leave the same losses, gradient norms and weights, experts included. A dp2·ep2 checkpoint
resumes bitwise into dp4·ep4, and the next update matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import hf_weights, torchrun

from spmd_rlhf.tiny.model import make_tiny

REFERENCE = "dp1ep1tp1pp1"
LAYOUTS = [
    "dp2ep2tp1pp1",
    "dp4ep2tp1pp1",
    "dp4ep4tp1pp1",
    "dp2ep2tp1pp2",
    "dp2ep2tp2pp1",
    "dp2ep2tp2pp1sp",
    "dp4ep2tp1pp1fsdp2",
]
"""``sp``: with sequence parallelism (the MoE blocks gather the row for the experts split over ep and tp). The last
with HSDP: the dense parts sharded over pairs of DP ranks and replicated across them, the experts FSDP-sharded over
efsdp (across the replicas) as without it."""


EIGHT_RANKS = ["dp4ep4tp2pp1"]
"""ep = 4 with tensor parallelism: a job of its own on 8 ranks (about 20 s on 2 cores), against ``run``'s reference."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    policy = make_tiny(family="qwen3_moe", out_dir=str(root / "policy"), hidden_size=32, vocab_size=300)
    out = root / "out"
    out.mkdir()
    finished = torchrun(
        "expert_parallel_parity.py", policy, str(out), REFERENCE, *LAYOUTS, nproc=4, timeout=300, forked=True
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    return policy, out


@pytest.fixture(scope="module")
def run_eight(run):
    policy, out = run
    finished = torchrun("expert_parallel_parity.py", policy, str(out), *EIGHT_RANKS, nproc=8, timeout=300, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return policy, out


def _outputs(request, layout: str) -> tuple[str, Path]:
    return request.getfixturevalue("run_eight" if layout in EIGHT_RANKS else "run")


@pytest.mark.parametrize("layout", LAYOUTS + EIGHT_RANKS)
def test_log_probs_match_one_rank(request, layout):
    _, out = _outputs(request, layout)
    torch.testing.assert_close(
        torch.load(out / f"{layout}.pt"), torch.load(out / f"{REFERENCE}.pt"), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS + EIGHT_RANKS if "pp1" in layout])
def test_every_gradient_matches_one_rank(request, layout):
    """The router's too: under tp its gradient sums each rank's share of the experts' (``sum_gradient_over``)."""
    _, out = _outputs(request, layout)
    reference, gradients = torch.load(out / f"{REFERENCE}_gradients.pt"), torch.load(out / f"{layout}_gradients.pt")
    assert gradients.keys() == reference.keys() and any(".mlp.gate." in name for name in reference)
    for name in reference:
        torch.testing.assert_close(gradients[name], reference[name], rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")


@pytest.mark.parametrize("layout", LAYOUTS + EIGHT_RANKS)
def test_two_updates_match_one_rank(request, layout):
    policy, out = _outputs(request, layout)
    reference_metrics = json.loads((out / f"{REFERENCE}.json").read_text())
    metrics = json.loads((out / f"{layout}.json").read_text())
    for step, (reference_step, step_metrics) in enumerate(zip(reference_metrics, metrics)):
        for rank_metrics in step_metrics:
            for key in ("actor/loss", "actor/grad_norm"):
                assert rank_metrics[key] == pytest.approx(reference_step[0][key], rel=1e-5), (layout, step, key)
    reference, weights = hf_weights(f"{out}/{REFERENCE}_actor"), hf_weights(f"{out}/{layout}_actor")
    assert weights.keys() == reference.keys()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in weights  # the published per-expert layout
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-5, atol=2e-6, msg=f"{layout} {name}")
    initial = load_file(f"{policy}/model.safetensors")
    trained = [name for name in reference if ".experts." in name]
    assert max(float((reference[name] - initial[name]).abs().max()) for name in trained) > 1e-4  # experts trained


def test_checkpoint_resumes_into_another_expert_layout(run):
    _, out = run
    saved, resumed = hf_weights(f"{out}/dp2ep2tp1pp1_actor"), hf_weights(f"{out}/resumed_actor")
    assert all(saved[name].equal(resumed[name]) for name in saved)
    metrics = json.loads((out / "resume.json").read_text())
    for key in ("actor/loss", "actor/grad_norm", "actor/lr"):
        assert metrics["resumed"][0][key] == pytest.approx(metrics["saved"][0][key], rel=1e-5), key
    saved, resumed = hf_weights(f"{out}/saved_next"), hf_weights(f"{out}/resumed_next")
    for name in saved:
        torch.testing.assert_close(resumed[name], saved[name], rtol=1e-5, atol=2e-6, msg=name)
