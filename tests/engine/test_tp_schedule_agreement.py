"""A tensor-parallel replica's ranks agree on the schedule-shaping numbers: different local KV budgets give one
schedule (that of the smallest budget) and the single-rank engine's tokens."""

import json
import sys
from pathlib import Path

from torchrun_helpers import torchrun

sys.path.insert(0, str(Path(__file__).parent / "programs"))
from tp_schedule_agreement import ARGS  # noqa: E402


def test_different_local_budgets_give_one_schedule(tmp_path):
    out = tmp_path / "results.json"
    finished = torchrun("tp_schedule_agreement.py", str(out), nproc=2, timeout=180, forked=True)
    assert finished.returncode == 0, finished.stdout[-6000:]
    results = json.loads(out.read_text())
    first, second = results["ranks"]
    reference, roomy = results["reference"], results["roomy_reference"]
    assert first == second
    assert first["num_blocks"] == reference["num_blocks"] == 10
    assert first["steps"] == reference["steps"] and first["preemptions"] == reference["preemptions"]
    assert first["tokens"] == reference["tokens"]
    # The budgets really shape the schedule: the smaller one preempts, the larger one schedules differently.
    assert reference["preemptions"] > 0 and roomy["steps"] != reference["steps"]
    # On local shards, through the graphs' padded static step (its scratch block leaves one fewer for sequences, so
    # its schedule may differ): the same tokens.
    static = results["local_static"]
    assert static["tokens"] == reference["tokens"], (static["num_blocks"], reference["num_blocks"])
    assert static["static_steps"] > 0 and first["static_steps"] == 0
    # The same on blocks compiled around attention: the row-parallel all-reduces traced into the graphs (those of
    # the second piece, for one token and for many), and no more graphs than on one rank: every layer shares them.
    compiled, one_rank = results["local_compiled"], results["one_rank_compiled"]
    assert compiled["tokens"] == reference["tokens"] and compiled["static_steps"] > 0
    assert compiled["collective_graphs"] == 2 and one_rank["collective_graphs"] == 0
    assert compiled["graphs"] == one_rank["graphs"] and compiled["calls"] > 0


def test_graphs_take_a_tensor_parallel_model_on_local_shards_and_refuse_dtensor_dispatch(monkeypatch):
    """A TP model dispatching through DTensor is refused graphs for that; on local shards it passes that check (and
    here meets the next one: no CUDA device)."""
    import torch

    from spmd_rlhf.engine import decode_graphs
    from spmd_rlhf.models.decoder import DecoderLM

    model = DecoderLM(ARGS)
    monkeypatch.setattr(decode_graphs, "DTensor", torch.nn.Parameter)  # every parameter counts as a DTensor here
    assert "dispatch through DTensor" in decode_graphs.graphs_unsupported(model, block_size=16)
    model.local_tensor_parallel = True
    assert decode_graphs.graphs_unsupported(model, block_size=16) == "the model is on cpu, not a CUDA device"
