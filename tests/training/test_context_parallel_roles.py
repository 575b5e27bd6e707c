"""Context parallelism in every trained and scoring role (``programs/context_parallel_parity.py``): a tiny Qwen3 actor
(per-head q/k norms, 4 query and 2 key/value heads), a critic and a reward model under ``cp`` 2 and 4 over 2 or 4 CPU
ranks, with two cp groups (dp4·cp2, also under HSDP: fsdp_size 2) and with tensor parallelism (dp2·cp2·tp2, also with
sequence parallelism), by Ulysses and by ring attention (``cp_attention=ring``: zig-zag chunks, cp = 4 beyond the 2
key/value heads), equal one rank: log-probs, values and scores; every gradient of the summed log-probs; two actor
updates (loss, gradient norm; each rank's own entropy and KL do not depend on the cp degree) and a critic update
(loss, gradient norm), and the actor's weights. Through a two-stage pipeline (dp2·cp2·pp2 ring: chunks padded to the
schedule's common shapes, the head's inputs gathered on the last stage) the same but the gradients. A token budget
that holds half the longest row trains at cp = 2 (and is refused at cp = 1). Mixture-of-experts models:
test_context_parallel_moe.py."""

from __future__ import annotations

import json

import pytest
import torch
from torchrun_helpers import hf_weights, torchrun

from spmd_rlhf.tiny.model import make_tiny

REFERENCE = "dp1cp1tp1"
LAYOUTS = [
    "dp4cp2tp1",
    "dp2cp2tp2",
    "dp4cp4tp1ring",
    "dp2cp2tp2ring",
    "dp2cp2tp2ringsp",
    "dp2cp2tp1pp2ring",
    "dp4cp2tp1fsdp2",
]
"""``sp``: every role with sequence parallelism too (each rank's chunk split again over tp; ring attention, whose
zig-zag chunks are the stricter padding, where Ulysses takes the chunk after the same gather)."""
"""The last with HSDP: each cp pair FSDP-sharded within itself, the two pairs replicas."""
BY_CP = {2: "dp4cp2tp1", 4: "dp4cp4tp1ring"}
"""The dp = 4 layouts whose per-rank metrics are compared across cp degrees (Ulysses' cp = 4 with key/value heads
replicated runs in tests/models/programs/ulysses_attention.py)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    common = dict(hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=300)
    policy = make_tiny(family="qwen3", out_dir=str(root / "policy"), **common)
    critic = make_tiny(family="llama", out_dir=str(root / "critic"), head="score", seed=1, **common)
    reward = make_tiny(family="llama", out_dir=str(root / "reward"), head="score", seed=2, **common)
    out = root / "out"
    out.mkdir()
    finished = torchrun(
        "context_parallel_parity.py",
        policy,
        critic,
        reward,
        str(out),
        REFERENCE,
        *LAYOUTS,
        nproc=4,
        timeout=300,
        forked=True,
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_outputs_match_one_rank(run, layout):
    reference, results = torch.load(run / f"{REFERENCE}.pt"), torch.load(run / f"{layout}.pt")
    for key in ("log_probs", "values", "scores"):
        torch.testing.assert_close(results[key], reference[key], rtol=1e-5, atol=1e-5, msg=f"{layout} {key}")


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if "pp" not in layout])
def test_every_gradient_matches_one_rank(run, layout):
    reference, gradients = torch.load(run / f"{REFERENCE}_gradients.pt"), torch.load(run / f"{layout}_gradients.pt")
    assert gradients.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(gradients[name], reference[name], rtol=1e-5, atol=5e-6, msg=f"{layout} {name}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_updates_match_one_rank(run, layout):
    reference_metrics = json.loads((run / f"{REFERENCE}.json").read_text())
    metrics = json.loads((run / f"{layout}.json").read_text())
    for role in ("actor", "critic"):
        for step, (expected, measured) in enumerate(zip(reference_metrics[role], metrics[role])):
            for rank_metrics in measured:
                for key in (f"{role}/loss", f"{role}/grad_norm"):  # reduced over the DP ranks
                    assert rank_metrics[key] == pytest.approx(expected[0][key], rel=1e-5), (layout, step, key)
    reference, weights = hf_weights(f"{run}/{REFERENCE}_actor"), hf_weights(f"{run}/{layout}_actor")
    assert weights.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-5, atol=5e-6, msg=f"{layout} {name}")


def test_the_padding_that_makes_rows_divisible_is_counted(run):
    """Rows of 5 prompt and 1-6 response tokens, two per micro-batch: some packed rows are odd, so cp = 2 pads them,
    one token each; ring attention at cp = 4 pads to a multiple of 8 (2 cp zig-zag chunks), up to seven."""
    two, four = (json.loads((run / f"{layout}.json").read_text())["actor"] for layout in BY_CP.values())
    padded_two, padded_four = (sum(rank["actor/cp_padding_tokens"] for rank in runs[0]) for runs in (two, four))
    assert 0 < padded_two < padded_four
    assert "actor/cp_padding_tokens" not in json.loads((run / f"{REFERENCE}.json").read_text())["actor"][0][0]


def test_each_ranks_own_metrics_do_not_depend_on_the_cp_degree(run):
    """Entropy and KL are each DP rank's own rows' (not reduced): at dp = 4, cp = 2 (Ulysses) and cp = 4 (ring) give
    every rank the same values."""
    two, four = (json.loads((run / f"{layout}.json").read_text())["actor"] for layout in BY_CP.values())
    for step in range(2):
        for rank in range(4):
            for key in ("actor/entropy", "actor/kl_loss", "actor/approx_kl"):
                assert two[step][rank][key] == pytest.approx(four[step][rank][key], rel=1e-5), (step, rank, key)


def test_a_row_longer_than_the_token_budget_trains_at_cp_2(run):
    """Budget 6, rows up to 11 tokens: each rank's chunk fits; the updates equal one rank's (micro-batched by rows)."""
    reference = json.loads((run / f"{REFERENCE}.json").read_text())["actor"]
    budget = json.loads((run / "budget.json").read_text())
    for step in range(2):
        for rank_metrics in budget[step]:
            for key in ("actor/loss", "actor/grad_norm"):
                assert rank_metrics[key] == pytest.approx(reference[step][0][key], rel=1e-5), (step, key)


def test_the_budget_must_hold_a_rows_chunk():
    from spmd_rlhf.config import ConfigError, load_config

    settings = ["data.max_prompt_length=5", "rollout.max_new_tokens=6", "actor.max_tokens_per_micro_batch=6"]
    with pytest.raises(ConfigError, match=r"actor\.max_tokens_per_micro_batch=6: must hold the longest row, .* = 11"):
        load_config(None, settings)
    load_config(None, [*settings, "actor.cp=2"])
    with pytest.raises(ConfigError, match=r"must hold its actor\.cp=2 chunk of the longest row, .* at least 6"):
        load_config(None, [*settings[:2], "actor.max_tokens_per_micro_batch=5", "actor.cp=2"])
