"""The 3D-HybridEngine on 4 CPU ranks: greedy generation in every generation layout (tp_g dividing the training tp, with
FSDP, with HSDP, with pp=2) equals the single-rank generation token for token; peak memory per rank stays within
training state + generation shard + KV cache (+ one block's gather buffers) and below a full copy when tp_g > 1; a
generation round trip leaves the weights bitwise equal; after an update, generation equals a fresh single-rank actor
loaded with the updated weights. The same for a tied policy whose vocabulary streams over dp = 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_helpers import hf_weights, torchrun

from spmd_rlhf.hybrid import GenerationLayout
from spmd_rlhf.runtime import ParallelDims
from spmd_rlhf.tiny.model import make_tiny

# (dp, tp, pp): tp_g for every tp_g dividing tp; with FSDP (dp > 1) and without; pp = 2 gathered into one model.
LAYOUTS = [
    "dp4tp1pp1:1",
    "dp2tp2pp1:1",
    "dp2tp2pp1:2",
    "dp1tp4pp1:1",
    "dp1tp4pp1:2",
    "dp1tp4pp1:4",
    "dp2tp1pp2:1",
    "dp1tp2pp2:1",
    "dp1tp2pp2:2",
    "dp1tp2pp2:1r",  # a pool listed in descending order: stages are not in process-group rank order
    "dp4tp1pp1fsdp2:1",  # HSDP: FSDP's gather within each pair of DP ranks, two replicas
]


def test_layout_groups():
    layout = GenerationLayout(ParallelDims(pp=2, dp=1, tp=4), tuple(range(8)), tp=2)
    assert layout.micro_dp == 2 and layout.num_replicas == 4
    # Training TP rank r = j * m + i: shard j, micro-DP neighbours consecutive, generation TP peers strided.
    assert layout.micro_dp_group(5) == [4, 5] and layout.generation_tp_group(5) == [5, 7]
    assert layout.row_group(5) == [0, 1, 4, 5] and layout.replica_index(5) == 3 and layout.shard_index(5) == 0
    with pytest.raises(ValueError, match="rollout.tp=3 must divide actor.tp=4"):
        GenerationLayout(ParallelDims(tp=4), tuple(range(4)), tp=3)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """``hybrid_generation.py`` in one job on two tiny policies, each in the one-rank layout and its own layouts:
    a 4-layer llama in ``LAYOUTS``, then a tied qwen2 of one FSDP unit per layer, so its vocabulary streams over
    dp = 2. Each policy's output directory and results, by name."""
    root = tmp_path_factory.mktemp("hybrid")
    policies = {"untied": ("llama", 4, LAYOUTS), "tied": ("qwen2", 2, ["dp2tp1pp1:1"])}
    arguments = []
    for name, (family, num_layers, layouts) in policies.items():
        policy = make_tiny(
            family=family,
            out_dir=str(root / name / "policy"),
            hidden_size=32,
            num_heads=4,
            num_kv_heads=4,
            vocab_size=300,
            num_layers=num_layers,
        )
        (root / name / "out").mkdir()
        arguments += [*(["+"] if arguments else []), policy, str(root / name / "out"), "dp1tp1pp1:1", *layouts]
    finished = torchrun("hybrid_generation.py", *arguments, nproc=4, timeout=400)
    assert finished.returncode == 0, finished.stdout[-6000:]
    return {
        name: (root / name / "out", json.loads((root / name / "out" / "results.json").read_text())) for name in policies
    }


@pytest.fixture(scope="module")
def run(job) -> tuple[Path, dict]:
    return job["untied"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generation_equals_single_rank(run, layout):
    _, results = run
    reference = results["dp1tp1pp1:1"]["measured"][0]["responses"]
    dp, tp = int(layout[2]), int(layout[5])
    rows = len(reference) // dp
    for role_rank, rank_result in enumerate(results[layout]["measured"]):
        # Every rank of a DP group (all its TP and PP ranks) holds the group's whole share of the prompts, in order.
        group = (role_rank // tp) % dp
        assert rank_result["responses"] == reference[group * rows : (group + 1) * rows], role_rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_peak_memory_within_bound(run, layout):
    _, results = run
    tp_g = int(layout.split(":")[1].rstrip("r"))
    for rank_result in results[layout]["measured"]:
        generation, kv, block = rank_result["generation_bytes"], rank_result["kv_bytes"], rank_result["block_bytes"]
        assert generation > 0 and kv > 0
        assert generation < rank_result["full_model_bytes"] * (1 / tp_g + 0.01)  # one shard (+ replicated norms)
        # Resharding (training -> generation) adds the generation shard plus one block's transient buffers (FSDP's
        # all-gather input and output and the unsharded parameters, or the micro-DP / pipeline exchange buffers).
        assert rank_result["reshard_peak_increase"] <= generation + 3 * block, rank_result
        if tp_g > 1:
            # Generating, activations included, never costs what one full copy of the weights and the cache would.
            assert rank_result["peak_increase"] < rank_result["full_model_bytes"] + kv, rank_result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loading_never_holds_the_full_model(run, layout):
    """Built on the meta device and parallelized first, a rank reads the checkpoint one tensor at a time and keeps
    its own pieces: its peak while loading is its shard plus one whole tensor in flight (read, cast, and the
    intermediate of slicing it over two mesh dimensions), plus small buffers (1% of the model)."""
    _, results = run
    for rank_result in results[layout]["measured"]:
        assert rank_result["loading_peak"] <= (
            rank_result["training_bytes"]
            + 3 * rank_result["largest_tensor_bytes"]
            + rank_result["full_model_bytes"] // 100
        ), rank_result
        if layout.startswith(("dp4", "dp2", "dp1tp4")):
            assert rank_result["loading_peak"] < rank_result["full_model_bytes"], rank_result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_leaves_weights_bitwise_equal(run, layout):
    out, _ = run
    before, after = hf_weights(f"{out}/{layout}_before"), hf_weights(f"{out}/{layout}_after")
    assert before.keys() == after.keys()
    assert all(before[name].equal(after[name]) for name in before)


@pytest.mark.parametrize("layout", ["dp2tp1pp2:1", "dp1tp2pp2:1", "dp1tp4pp1:2", "dp1tp2pp2:1r", "dp4tp1pp1fsdp2:1"])
def test_generation_after_update_uses_new_weights(run, layout):
    _, results = run
    assert results[layout]["updated"] == results[layout]["fresh"]
    assert results[layout]["updated"] != results["dp1tp1pp1:1"]["measured"][0]["responses"]


@pytest.fixture(scope="module")
def tied_run(job) -> tuple[Path, dict]:
    return job["tied"]


def test_a_streamed_tied_vocabulary_generates_as_one_rank_before_and_after_an_update(tied_run):
    out, results = tied_run
    reference = results["dp1tp1pp1:1"]["measured"][0]["responses"]
    streamed = results["dp2tp1pp1:1"]
    rows = len(reference) // 2
    for role_rank, rank_result in enumerate(streamed["measured"]):
        assert rank_result["responses"] == reference[role_rank * rows : (role_rank + 1) * rows], role_rank
    assert streamed["updated"] == streamed["fresh"] and streamed["updated"] != reference
    before, after = hf_weights(f"{out}/dp2tp1pp1:1_before"), hf_weights(f"{out}/dp2tp1pp1:1_after")
    assert before.keys() == after.keys() and all(before[name].equal(after[name]) for name in before)
