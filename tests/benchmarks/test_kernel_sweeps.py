"""The kernels' tiling sweeps on CPU (``--smoke``: the torch paths stand in for the kernels, so the scripts, not the
figures, are checked). ``benchmarks/gpu_skinny_sweep.py``: every config runs every projection of both shapes, the best
config is the fastest block, each projection's fastest is what ``gpu_generate.py --skinny-config`` takes, and a
config that failed is reported and never chosen. ``benchmarks/gpu_paged_sweep.py``: every tiling in every regime.
``benchmarks/gpu_draw.py``: every case on both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gpu_generate import paged_tiling, skinny_tiling  # noqa: E402
from gpu_skinny import SKINNY_SHAPES  # noqa: E402
from gpu_skinny_sweep import SWEEP, summarise  # noqa: E402
from gpu_timing import GRAPH_CALLS  # noqa: E402

from spmd_rlhf.engine.decode_matmul import DEFAULT_TILINGS  # noqa: E402
from spmd_rlhf.kernels.paged_attention import DEFAULT_PAGED_CONFIG, PagedConfig  # noqa: E402
from spmd_rlhf.kernels.skinny_linear import SkinnyConfig  # noqa: E402


def smoke_result(script: str, out: Path) -> dict:
    """``benchmarks/<script>.py --smoke`` run in a fresh interpreter, writing to ``out``: its result on CPU."""
    finished = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke", "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    return json.loads((out / f"{script}_cpu.json").read_text())


def test_the_smoke_sweep_times_every_config_and_picks_the_fastest_block(tmp_path):
    result = smoke_result("gpu_skinny_sweep", tmp_path)
    assert result["smoke"] and len(result["configs"]) == len(SWEEP) and set(result["shapes"]) == set(SKINNY_SHAPES)
    for figures in result["shapes"].values():
        assert set(figures["projections"]) == {"qkv", "o", "gate_up", "down"}
        for projection in figures["projections"].values():
            assert projection["torch_us"] > 0
            for index in range(len(SWEEP)):
                assert projection[str(index)]["us"] > 0 and projection[str(index)]["relative_error"] < 1e-5
        blocks = figures["block_us"]
        assert figures["best"] == int(min(blocks, key=blocks.get))
        best_us = blocks[str(figures["best"])]
        assert figures["best_saved_us_per_28_layer_step_over_default"] == (blocks["0"] - best_us) * GRAPH_CALLS

    # G1 with the kernels (gpu_generate --skinny-config, the suite's g1_skinny) takes the sweep's best tiling for its
    # shape from the folder the sweep wrote to (another shape: the sweep's first), the defaults where it finds none.
    def fastest(swept: str) -> dict[str, SkinnyConfig]:
        """Each projection's fastest tiling at ``swept``, taking one row as the engine's defaults do."""
        projections = result["shapes"][swept]["projections"]
        return {
            name: replace(SWEEP[min(range(len(SWEEP)), key=lambda index: timings[str(index)]["us"])], max_rows=1)
            for name, timings in projections.items()
        }

    for shape, swept in (("7b", "7b"), ("smoke", "1.5b")):
        tiling, source = skinny_tiling(str(tmp_path), shape)
        assert tiling == fastest(swept) and "the best of" in source
    assert skinny_tiling(None, "1.5b") == (DEFAULT_TILINGS, "the defaults")
    assert skinny_tiling(str(tmp_path / "nothing"), "1.5b")[0] == DEFAULT_TILINGS
    assert skinny_tiling(str(tmp_path / "gpu_skinny_sweep_cpu.json"), "7b")[0] == fastest("7b")  # the file itself
    (tmp_path / "empty").mkdir()
    assert skinny_tiling(str(tmp_path / "empty"), "1.5b")[0] == DEFAULT_TILINGS
    assert skinny_tiling('{"prefetch": true}', "1.5b")[0] == SkinnyConfig(prefetch=True)


def test_a_config_that_failed_is_reported_and_never_best():
    projections = {
        name: {"torch_us": 10.0} | {str(index): {"us": 5.0 + index} for index in range(len(SWEEP))}
        for name in ("qkv", "o")
    }
    projections["o"]["0"] = {"us": None, "error": "CompilationError: out of resources"}
    summary = summarise(projections)
    assert summary["block_us"]["0"] is None and summary["best"] == 1
    assert summary["best_saved_us_per_28_layer_step_over_default"] is None
    assert summary["best_saved_us_per_28_layer_step_over_torch"] == (20.0 - 12.0) * GRAPH_CALLS


def test_the_paged_kernel_sweep_times_every_tiling_in_every_regime(tmp_path):
    """``benchmarks/gpu_paged_sweep.py --smoke``: each regime times every tiling of its sweep (the torch path on CPU),
    each output checked against the default tiling's, the best the fastest, its speed-up over the default."""
    from gpu_paged_sweep import REGIMES
    from gpu_paged_sweep import SWEEP as PAGED_SWEEP

    result = smoke_result("gpu_paged_sweep", tmp_path)
    assert set(result["regimes"]) == set(REGIMES) and len(result["configs"]) == len(PAGED_SWEEP)
    for figures in result["regimes"].values():
        times = {index: config["us"] for index, config in figures["configs"].items()}
        assert len(times) == len(PAGED_SWEEP) and all(us > 0 for us in times.values())
        assert all(config["relative_difference"] < 1e-5 for config in figures["configs"].values())
        assert figures["best"] == int(min(times, key=times.get))
        assert figures["best_speedup_over_default"] == times["0"] / times[str(figures["best"])]
    # G1 with the tuned kernels (gpu_generate --paged-config, the suite's g1_skinny) takes the best at batch 1.
    tiling, source = paged_tiling(str(tmp_path))
    assert tiling == PagedConfig(**result["regimes"]["batch1_256"]["best_config"]) and "the best of" in source
    assert paged_tiling(None) == (DEFAULT_PAGED_CONFIG, "the defaults")
    assert paged_tiling('{"num_warps": 8}')[0] == PagedConfig(num_warps=8)


def test_the_smoke_draw_benchmark_times_every_case_on_both_sides(tmp_path):
    """``benchmarks/gpu_draw.py --smoke``: greedy and sampled draws at 1 and 256 rows, both sides timed (eager on
    CPU), the same tokens, a result written."""
    result = smoke_result("gpu_draw", tmp_path)
    assert set(result["cases"]) == {"greedy_1", "greedy_256", "sampled_1", "sampled_256"} and not result["compiled"]
    for figures in result["cases"].values():
        assert figures["eager_us"] > 0 and figures["compiled_us"] > 0 and figures["tokens_equal"]


def test_the_suites_sweep_figures_name_the_tilings_they_read():
    # gpu_suite.py reads the skinny sweep's tilings 5, 17 and 18 and the paged sweep's 0 and 9 to 12 by position.
    from gpu_paged_sweep import SWEEP as PAGED_SWEEP

    assert SWEEP[5].num_warps == 2 and SWEEP[17] == replace(SWEEP[5], last_sums=False)
    assert PAGED_SWEEP[0] == DEFAULT_PAGED_CONFIG and PAGED_SWEEP[9] == PagedConfig(last_combines=False)
    assert PAGED_SWEEP[10] == PagedConfig(max_splits=1) and PAGED_SWEEP[11] == PagedConfig(max_splits=2)
    assert PAGED_SWEEP[12] == PagedConfig(dependent_launch=True)
    assert SWEEP[18] == replace(SWEEP[5], dependent_launch=True)
