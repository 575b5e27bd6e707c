"""A tensor-parallel replica's ranks agree on the schedule-shaping numbers: different local KV budgets give one
schedule (that of the smallest budget) and the single-rank engine's tokens."""

import json

from torchrun_helpers import torchrun


def test_different_local_budgets_give_one_schedule(tmp_path):
    out = tmp_path / "results.json"
    finished = torchrun("tp_schedule_agreement.py", str(out), nproc=2, timeout=180)
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
