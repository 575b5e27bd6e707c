"""The GPU benchmarks (``benchmarks/gpu_*.py``) in their ``--smoke`` mode: each script end to end on a tiny model, on
whatever device this machine has, writing JSON that holds every figure (finite, consistent with each other), names
the device it ran on and never claims a GPU result. Speed itself is not asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gpu_common import known_peak_tflops, meets_goal, peak_tflops, shaped_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_smoke(script: str, out_dir: Path, *extra: str) -> tuple[dict, str]:
    """Run ``benchmarks/<script> --smoke`` with one OpenMP thread; its JSON result and its output."""
    finished = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out_dir), *extra],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    (path,) = out_dir.glob("*.json")
    result = json.loads(path.read_text())
    assert result["smoke"] is True
    assert result["environment"]["device"] == DEVICE
    assert result["environment"]["command"].startswith(f"python {BENCHMARKS / script} --smoke")
    assert "SMOKE RUN: not a GPU figure" in finished.stdout
    return result, finished.stdout


def assert_positive_finite(values: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(values[key], (int, float)) and math.isfinite(values[key]) and values[key] > 0, (
            key,
            values[key],
        )


def test_generate_decode_and_batch(tmp_path):
    result, _ = run_smoke("gpu_generate.py", tmp_path)
    decode, batch = result["decode"], result["batch"]
    assert_positive_finite(decode, "decode_tokens_per_s", "floor_tokens_per_s", "ratio_to_floor", "copy_bytes_per_s")
    assert (
        decode["weight_bytes"]
        == result["parameters"] * torch.empty((), dtype=getattr(torch, result["dtype"])).element_size()
    )
    assert decode["floor_tokens_per_s"] == pytest.approx(decode["copy_bytes_per_s"] / decode["weight_bytes"])
    assert decode["ratio_to_floor"] == pytest.approx(decode["decode_tokens_per_s"] / decode["floor_tokens_per_s"])
    for mode in ("auto", "off"):
        assert decode["seconds"][f"{mode}_to_last_token"] > decode["seconds"][f"{mode}_to_first_token"]
    assert decode["graphs_speedup"] == pytest.approx(decode["decode_tokens_per_s"] / decode["eager_tokens_per_s"])
    assert decode["cuda_graphs"] == 0  # CPU: eager decode steps in both engines
    assert_positive_finite(
        batch, "engine_s", "transformers_s", "speedup", "engine_tokens_per_s", "transformers_tokens_per_s"
    )
    assert batch["speedup"] == pytest.approx(batch["transformers_s"] / batch["engine_s"])
    assert batch["engine_stats"]["generated_tokens"] == batch["batch"] * batch["new_tokens"]
    assert decode["meets_goal"] is None and batch["meets_goal"] is None


def test_update_actor_mfu(tmp_path):
    result, _ = run_smoke("gpu_update.py", tmp_path, "--peak-tflops", "0.1")
    assert result["peak_tflops"] == 0.1
    assert [row["length"] for row in result["per_length"]] == [16, 24]
    for row in result["per_length"]:
        assert_positive_finite(row, "step_s", "tokens_per_s", "tflops_per_device", "mfu", "mfu_with_attention")
        assert row["tokens_per_step"] == row["rows"] * row["length"]
        assert row["mfu"] == pytest.approx(row["tflops_per_device"] / 0.1)
        assert row["mfu"] < row["mfu_with_attention"]
        assert row["meets_goal"] is None


def test_grpo_against_trl(tmp_path):
    pytest.importorskip("trl")
    result, _ = run_smoke("gpu_grpo.py", tmp_path)
    config = result["config"]
    samples = config["prompts"] * config["n"]
    for name in ("spmd_rlhf", "trl"):
        run = result[name]
        assert_positive_finite(run, "step_s", "tokens_per_s", "tokens_per_step", "generated_tokens_per_s")
        # Every response has the prompt's tokens and 1 to new_tokens generated ones (EOS may end one early).
        shortest, longest = config["prompt_tokens"] + 1, config["prompt_tokens"] + config["new_tokens"]
        assert samples * shortest <= run["tokens_per_step"] <= samples * longest
    assert result["tokens_per_s_ratio"] == pytest.approx(
        result["spmd_rlhf"]["tokens_per_s"] / result["trl"]["tokens_per_s"]
    )
    assert result["meets_goal"] is None


def test_reshard_on_one_rank_reports_no_all_gather_ratio(tmp_path):
    result, _ = run_smoke("gpu_reshard.py", tmp_path)
    (row,) = result["results"].values()
    assert row["ratio_to_bound"] is None and row["meets_goal"] is None
    assert row["degenerate"].startswith("world size 1")
    assert_positive_finite(row, "ratio_to_copy_bound", "copy_bound_s", "copy_bytes_per_s", "naive_ratio")
    assert_positive_finite(row["seconds"], "to_generation", "naive")
    assert row["copy_bound_s"] == pytest.approx(row["copy_moved_bytes"] / row["copy_bytes_per_s"])


def test_model_dir_is_reused_only_for_its_shape(tmp_path):
    model_dir = str(tmp_path / "model")
    with shaped_model("smoke", model_dir) as path:
        assert path == model_dir
    weights = Path(model_dir) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    with shaped_model("smoke", model_dir):
        assert weights.stat().st_mtime_ns == written
    with pytest.raises(ValueError, match="hidden_size=64, not the 0.5b shape's 896"):
        with shaped_model("0.5b", model_dir):
            pass


def test_peak_and_goal_rules():
    assert peak_tflops("cpu", None) is None
    assert peak_tflops("cpu", 12.5) == 12.5
    peaks = {
        "NVIDIA H100 80GB HBM3": 989.0,
        "NVIDIA H100 PCIe": 756.0,
        "NVIDIA H200": 989.0,
        "NVIDIA A100-SXM4-80GB": 312.0,
        "NVIDIA GeForce RTX 4090": None,
    }
    assert {name: known_peak_tflops(name) for name in peaks} == peaks
    assert meets_goal(0.6, 0.5, at_least=True, real_run=True) is True
    assert meets_goal(1.4, 1.3, at_least=False, real_run=True) is False
    assert meets_goal(0.6, 0.5, at_least=True, real_run=False) is None


def test_kernels_at_real_sizes_script(tmp_path):
    result, _ = run_smoke("gpu_kernels.py", tmp_path)
    paged, fused = result["paged_decode"], result["fused_logprob"]
    assert_positive_finite(paged, "kernel_s", "reference_s", "speedup", "floor_s", "kernel_over_floor")
    assert paged["speedup"] == pytest.approx(paged["reference_s"] / paged["kernel_s"])
    assert paged["floor_s"] == pytest.approx(paged["kv_bytes"] / paged["copy_bytes_per_s"])
    assert_positive_finite(fused, "kernel_s", "reference_s", "speedup")
    assert paged["meets_goal"] is None and fused["meets_goal"] is None


def test_gpu_suite_runs_steps_and_reports_the_budget(tmp_path):
    """The suite in smoke mode: one real step with its figures in the one JSON file, and a budget too small for any
    step reports every step as skipped instead of dropping it."""

    def suite(*arguments: str) -> dict:
        finished = subprocess.run(
            [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--smoke", "--out", str(tmp_path), *arguments],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        assert finished.returncode == 0, finished.stdout[-4000:]
        assert "SMOKE RUN: not a GPU figure" in finished.stdout
        return json.loads((tmp_path / f"gpu_suite_{DEVICE}_smoke.json").read_text())

    report = suite("--only", "kernels")
    step = report["steps"]["kernels"]
    assert step["status"] == "passed" and set(report["steps"]) == {"kernels"}
    assert step["figures"]["paged_decode_speedup"] == step["result"]["paged_decode"]["speedup"]
    report = suite("--budget-s", "0")
    assert [record["status"] for record in report["steps"].values()] == ["skipped"] * 9
    from gpu_suite import PARTS

    assert sorted(sum(PARTS.values(), [])) == sorted(report["steps"]), "every step belongs to exactly one part"


def test_suite_digs_figures_out_of_nested_results():
    from gpu_suite import dig

    result = {"a": [{"x": 1}, {"x": 2}], "results": {"dp1": {"ratio": 0.5}}}
    assert dig(result, "a.-1.x") == 2 and dig(result, "results.*.ratio") == 0.5
    assert dig(result, "a.5.x") is None and dig(result, "missing.key") is None
