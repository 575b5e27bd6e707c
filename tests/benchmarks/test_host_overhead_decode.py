"""``benchmarks/host_overhead.py --decode`` on small models: the work outside the graph does not depend on the depth,
the graphed step grows by the same calls per layer as the eager step, each figure carries its goal, and the
overlapped loop makes no sync in steady state."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from host_overhead_decode import compiled_graph_launches, decode_figures  # noqa: E402


def _figures(layers: int) -> dict[str, dict]:
    args = argparse.Namespace(
        decode_layers=layers, decode_batch=4, decode_steps=2, decode_max_len=64, decode_compiled=False
    )
    return {row["figure"]: row for row in decode_figures(args)}


def test_the_compiled_blocks_count_is_taken_inside_the_captured_step():
    """``compiled_graph_launches`` counts what runs inside each captured step of a model whose blocks are compiled
    around attention: traced by ``aot_eager`` here (ATen calls; Inductor's kernels in the benchmark), the same per
    layer at 2 and 3 layers: three matmuls besides the q/k/v one (with its bias, an ``addmm``)."""
    two, three = (compiled_graph_launches(layers, 2, backend="aot_eager") for layers in (2, 3))
    per_layer = sum(three.values()) - sum(two.values())
    assert 0 < per_layer < sum(two.values()) and three["aten::mm"] - two["aten::mm"] == 3  # o, gate/up, down
    assert three["aten::addmm"] - two["aten::addmm"] == 1


def test_decode_counts_split_the_step_at_the_graph():
    two, three = _figures(2), _figures(3)
    for path in ("outside the graph, greedy", "outside the graph, sampled"):
        assert (
            two[f"dispatcher calls per step, {path}"]["value"] == three[f"dispatcher calls per step, {path}"]["value"]
        )
        assert 0 < two[f"non-view calls per step, {path}"]["value"] < 60
    per_layer = {
        path: three[f"dispatcher calls per step, {path}"]["value"] - two[f"dispatcher calls per step, {path}"]["value"]
        for path in ("engine eager", "graphed step, greedy", "graphed step, sampled")
    }
    # The captured step's block tables are as wide as the longest row the engine is prepared for, so at batch 1 the
    # paged kernel splits the context (the stand-in's partial results: one call more per layer, their combine
    # inside the same launch); the eager step's tables are as wide as its rows, a block here: one program per KV head.
    split_k_calls = 1
    assert (
        per_layer["graphed step, greedy"]
        == per_layer["graphed step, sampled"]
        == per_layer["engine eager"] + split_k_calls
    )
    assert per_layer["engine eager"] > 0
    assert two["kernels per graphed step, greedy"]["meets_goal"] is True  # two layers: far under 500
    syncs = two["syncs per step, graphed"]
    assert syncs["goal"] == "0 in steady state" and syncs["meets_goal"] == (syncs["value"] == 0)
    # The overlapped loop reads each step's samples one step late instead; the synchronous one syncs every step.
    assert syncs["value"] == 0 and syncs["late_reads"] == 1
    assert two["syncs per step, graphed, synchronous loop"]["value"] == 1
    assert {
        "host µs per step, graph a no-op, batch 1, greedy",
        "host µs per step, graph a no-op, batch 4, sampled",
    } <= set(two)
