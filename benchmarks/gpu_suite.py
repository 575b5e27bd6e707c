"""Everything a machine with one GPU can tell us, in one command (``benchmarks/gpu_suite.sh`` calls this, after
installing the wheels ``benchmarks/gpu_wheels.sh`` put in ``.whl/``; docs/benchmarks.md says how to read the result):

    bash benchmarks/gpu_suite.sh --out "$OUT"          # one 10-minute call on a bare H100 / H200: 8 to 9.5 minutes
    bash benchmarks/gpu_suite.sh --only g5 scale       # any steps by name (optional ones too), in the order named
    python benchmarks/gpu_suite.py --smoke             # every step on tiny sizes, on CPU: checks the suite itself

Steps, in order (``STEPS``), each a subprocess under its own time limit: a step that runs past it is killed and
reported as ``timed_out``, one that fails as ``failed`` with its output's tail, and steps that no longer fit in
``--budget-s`` as ``skipped``: none is dropped silently, and the suite's JSON is written again after every step, so a
call cut short still returns what it measured. ``model`` builds the random-init 1.5B- and 0.5B-shaped models once in
``--work`` (a fixed directory: a second call on the same machine reuses them), and every later step reads them there.

| step | what | limit |
| --- | --- | --- |
| ``model`` | the 1.5B-shaped (G1, G2, G3, G5, scale) and 0.5B-shaped (G4) models, built once | 150 s |
| ``cuda_tests`` | one CUDA test from each file that has them (``FAST_CUDA_TESTS``; one compiles blocks) | 120 s |
| ``g1`` | G1: batch-1 and batch-64 decode against the HBM floor, graph vs eager | 150 s |
| ``g3`` | G3: ``update_actor`` MFU, 1.5B bf16, 32 rows x 1024 and 2048 tokens, compiled, token budget | 240 s |
| ``g4`` | G4: GRPO end to end against TRL ``GRPOTrainer`` without vLLM, 0.5B | 240 s |
| ``g2`` | G2: 256 prompts x 512 new tokens against ``generate`` with the dynamic cache | 180 s |
| ``kernels`` | the Triton kernels against torch; batch-1 attention and skinny linears in CUDA graphs | 120 s |
| ``g5`` | the reshard train -> generation against the device-copy bound for the same bytes | 60 s |

The goals' steps run first: on an H200 (session 44) the steps took 627 s where 520 s of budget let ``g2`` start with
25 s left, so ``kernels`` and ``g5``, which measure no goal, run last, and the default budget is 550 s (the call's
wall time is the budget plus about 20 s of install and start, inside a 600 s call).

Optional steps (``OPTIONAL``), run only when named in ``--only``: ``g1_skinny`` (G1 with the decode projections
through the skinny-linear kernels, as ``g1`` runs them by default, ``rollout.decode_matmul=auto``, but with the
tilings ``skinny_sweep`` and ``paged_sweep`` found best where they ran before it), ``g1_cublas`` (G1 with the
projections through ``F.linear``, ``rollout.decode_matmul=torch``: what the kernels gain), ``g1_pdl`` (G1 with the
decode kernels launched with programmatic dependent launch, ``--dependent-launch``: what overlapping each kernel's
start with the end of the one before saves),
``skinny_sweep`` (``gpu_skinny_sweep.py``: the skinny-linear kernels' tilings, ``SkinnyConfig``, against each other
and cuBLAS per projection at one row: which tiling ``g1_skinny`` should use), ``paged_sweep`` (``gpu_paged_sweep.py``:
the paged decode kernel's tilings and pipeline depths, ``PagedConfig``, at batch 1 and 256), ``draw``
(``gpu_draw.py``: the decode step's draw eager against compiled, greedy and sampled, at 1 and 256 rows),
``g1_eager_blocks`` (G1 with eager blocks,
``rollout.compile=off``: what compiling around attention gains; 29 % against 45 % of the floor on an H100), ``scale``
(per-stage ``max_memory_allocated`` against the floor, GRPO at the 1.5B shape on one rank: two minutes, which the plain
call no longer has on an H100 since G3 compiles and G4 ran 172 s), ``cuda_tests_full`` (every test marked ``gpu``),
``g2_static`` (G2 against the compiled static cache: a compile of minutes) and ``two_process`` (the GRPO recipe as a
two-process torchrun job; NCCL refuses two ranks on one GPU, so it needs two GPUs, or CPU under ``--smoke``) and ``moe``
(``moe_layer.py``: an MoE layer's grouped GEMMs against its expert loop at Qwen3-30B-A3B's widths, bf16), ``g3_rows``
(G3 with micro-batches of 2 rows, ``--token-budget null``, instead of the default token budget derived from the free
memory), ``g3_eager`` (G3 with eager blocks, ``--compile off``: what compiling gains), ``g3_selective`` (G3 with
selective activation checkpointing: what recomputing the elementwise work costs), ``g3_offload`` (G3 with the
activations in host memory, ``model.activation_offload``: what the PCIe copies cost).

Writes ``<out>/gpu_suite_<device>[_smoke].json``: the versions found, every step's status, time, headline figures and
its full JSON, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from gpu_common import environment

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
DEFAULT_WORK = Path("/tmp/spmd_gpu_suite")
VERSIONS = ("torch", "triton", "transformers", "peft", "safetensors", "numpy", "pyarrow", "omegaconf", "trl")
VERSIONS += ("datasets", "accelerate", "fsspec", "spmd_rlhf")
"""The packages whose versions the report records (``None``: not installed)."""

FAST_CUDA_TESTS = (
    "tests/models/test_gpu_parity.py::test_packed_equals_separate_on_cuda",
    "tests/engine/test_gpu_engine.py::test_flash_paged_kernel_log_probs_match_training_in_bf16",
    "tests/engine/test_decode_graphs.py::test_cuda_graph_decode_equals_eager_decode",
    "tests/kernels/test_paged_attention.py::test_cuda_decode_step_through_attend_matches_the_gather_path",
    "tests/kernels/test_fused_logprob.py::test_cuda_forward_and_backward_allocate_no_float32_table",
    "tests/models/test_moe.py::test_cuda_bf16_experts_grouped_equal_looped_and_the_model_runs",
    "tests/models/test_compiled_blocks.py::test_cuda_inductor_blocks_equal_eager_in_bf16",
    "tests/engine/test_overlap.py::test_overlapped_cuda_graph_loop_equals_the_synchronous_loop",
    "tests/engine/test_compiled_decode.py::test_cuda_compiled_layers_decode_like_eager_layers",
    "tests/kernels/test_skinny_linear.py::test_cuda_bf16_kernels_match_float64_and_replay_in_a_cuda_graph",
    "tests/metrics/test_device_syncs.py::test_cuda_reads_of_device_tensors_are_counted_and_launches_are_not",
)
"""``cuda_tests``: one test from each file that holds CUDA tests (the whole ``-m gpu`` run took 50 s on an H100)."""


@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: int
    json_glob: str | None = None
    """Pattern (under the step's output directory) of the JSON the step writes."""
    headline: dict[str, str] = field(default_factory=dict)
    """Figure name -> dotted path into that JSON."""


def steps(python: str, smoke: bool, work: Path, out: Path) -> list[Step]:
    """Every step, ``STEPS`` then ``OPTIONAL``; ``--smoke`` passes ``--smoke`` to each benchmark and builds the
    models at the smoke shape."""
    smoke_flag = ["--smoke"] if smoke else []
    large, small = ("smoke", "smoke") if smoke else ("1.5b", "0.5b")
    model_dir = {shape: work / f"model_{shape}" for shape in (large, small)}
    large_model = ["--shape", large, "--model-dir", str(model_dir[large])]
    small_model = ["--shape", small, "--model-dir", str(model_dir[small])]
    step_out = lambda name: ["--out", str(work / name)]  # noqa: E731 (one line per step reads best)
    pytest = [python, "-m", "pytest", "-q", "-o", "addopts=-ra", "-p", "no:cacheprovider"]
    recipe_overrides = [
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "trainer.val_every=0",
        f"trainer.output_dir={work / 'two_process'}",
        "trainer.loggers=[jsonl]",
    ]
    generate = [python, str(BENCHMARKS / "gpu_generate.py"), *large_model, *smoke_flag]
    return [
        Step(
            "model",
            [python, str(BENCHMARKS / "gpu_common.py"), *(f"{shape}={path}" for shape, path in model_dir.items())],
            150,
        ),
        Step(
            "cuda_tests",
            [*pytest, "-m", "gpu", *FAST_CUDA_TESTS, f"--junitxml={work / 'cuda_tests.xml'}"],
            120,
        ),
        Step(
            "g1",
            [
                *generate,
                "--measure",
                "decode",
                *([] if smoke else ["--decode-tokens", "128", "--repeats", "2"]),
                *step_out("g1"),
                "--profile",
                str(out / "g1_decode_profile.txt"),
            ],
            150,
            "*.json",
            {
                "G1_batch1_over_floor": "decode.1.ratio_to_floor",
                "G1_batch1_tokens_per_s": "decode.1.decode_tokens_per_s",
                "G1_largest_batch_over_floor": "decode.-1.ratio_to_floor",
                "G1_graphs_speedup": "decode.1.graphs_speedup",
                "G1_first_mismatch": "decode.1.graph_eager_first_mismatch",
            },
        ),
        Step(
            "g1_eager_blocks",
            [
                *generate,
                "--measure",
                "decode",
                "--compile-layers",
                "off",
                *([] if smoke else ["--decode-tokens", "128", "--repeats", "2"]),
                *step_out("g1_eager_blocks"),
            ],
            180,
            "*.json",
            {
                "G1_eager_blocks_batch1_over_floor": "decode.1.ratio_to_floor",
                "G1_eager_blocks_largest_batch_over_floor": "decode.-1.ratio_to_floor",
                "G1_eager_blocks_first_mismatch": "decode.1.graph_eager_first_mismatch",
            },
        ),
        Step(
            "g1_pdl",
            [
                *generate,
                "--measure",
                "decode",
                "--dependent-launch",
                *([] if smoke else ["--decode-tokens", "128", "--repeats", "2"]),
                *step_out("g1_pdl"),
            ],
            150,
            "*.json",
            {
                "G1_pdl_batch1_over_floor": "decode.1.ratio_to_floor",
                "G1_pdl_largest_batch_over_floor": "decode.-1.ratio_to_floor",
                "G1_pdl_first_mismatch": "decode.1.graph_eager_first_mismatch",
            },
        ),
        Step(
            "g1_cublas",
            [
                *generate,
                "--measure",
                "decode",
                "--decode-matmul",
                "torch",
                *([] if smoke else ["--decode-tokens", "128", "--repeats", "2"]),
                *step_out("g1_cublas"),
            ],
            150,
            "*.json",
            {
                "G1_cublas_batch1_over_floor": "decode.1.ratio_to_floor",
                "G1_cublas_largest_batch_over_floor": "decode.-1.ratio_to_floor",
                "G1_cublas_first_mismatch": "decode.1.graph_eager_first_mismatch",
            },
        ),
        Step(
            "g1_skinny",
            [
                *generate,
                "--measure",
                "decode",
                "--decode-matmul",
                "triton",
                # The tilings skinny_sweep and paged_sweep found best, where they ran before it.
                "--skinny-config",
                str(work / "skinny_sweep"),
                "--paged-config",
                str(work / "paged_sweep"),
                *([] if smoke else ["--decode-tokens", "128", "--repeats", "2"]),
                *step_out("g1_skinny"),
                "--profile",
                str(out / "g1_skinny_decode_profile.txt"),
            ],
            150,
            "*.json",
            {
                "G1_skinny_batch1_over_floor": "decode.1.ratio_to_floor",
                "G1_skinny_largest_batch_over_floor": "decode.-1.ratio_to_floor",
                "G1_skinny_first_mismatch": "decode.1.graph_eager_first_mismatch",
                "G1_skinny_tiling": "decode_tiling.source",
                "G1_skinny_attention_tiling": "attention_tiling.source",
            },
        ),
        Step(
            "g3",
            [
                python,
                str(BENCHMARKS / "gpu_update.py"),
                *large_model,
                *smoke_flag,
                *([] if smoke else ["--repeats", "2"]),
                *step_out("g3"),
                # One more update under the profiler: where its time goes and each line where the host waited.
                "--profile",
                str(out / "g3_update_profile.txt"),
            ],
            240,
            "*.json",
            {"G3_mfu": "per_length.0.mfu", "G3_mfu_longest": "per_length.-1.mfu"},
        ),
        Step(
            "g4",
            [
                python,
                str(BENCHMARKS / "gpu_grpo.py"),
                *small_model,
                *smoke_flag,
                *([] if smoke else ["--prompts", "16", "--steps", "4", "--warmup", "2"]),
                *step_out("g4"),
                "--profile",
                str(out / "g4_step_profile.txt"),
            ],
            # 210 s on an H200 in session 44 (3 steps); since session 46 the warm-up step also compiles the draw.
            # Two warm-up steps: the second runs under the profiler (gpu_grpo), clear of the first one's compiles.
            270,
            "*.json",
            {"G4_tokens_per_s_ratio": "tokens_per_s_ratio", "G4_profiled_step_syncs": "spmd_rlhf.profile.device_syncs"},
        ),
        Step(
            "g2",
            [*generate, "--measure", "batch", *([] if smoke else ["--repeats", "1"]), *step_out("g2")],
            180,
            "*.json",
            {"G2_speedup_over_dynamic": "batch.dynamic.speedup", "G2_engine_tokens_per_s": "batch.engine_tokens_per_s"},
        ),
        Step(
            "kernels",
            [python, str(BENCHMARKS / "gpu_kernels.py"), *smoke_flag, *step_out("kernels")],
            120,
            "*.json",
            {
                "paged_decode_speedup": "paged_decode.speedup",
                "paged_over_floor": "paged_decode.kernel_over_floor",
                "paged_batch1_speedup": "paged_decode.batch1.0.speedup",
                "paged_batch1_saved_us_per_step": "paged_decode.batch1.0.saved_us_per_step_at_28_layers",
                "fused_speedup": "fused_logprob.speedup",
                "fused_peak_over_logits": "fused_logprob.kernel_peak_over_logits",
                # skinny_linear against F.linear: microseconds a 28-layer batch-1 step saves, 1.5B and 7B shapes.
                "skinny_saved_us_1.5b_batch1": "skinny_linear.saved_us_per_28_layer_step.0.1",
                "skinny_saved_us_7b_batch1": "skinny_linear.saved_us_per_28_layer_step.1.1",
            },
        ),
        Step(
            "draw",
            [python, str(BENCHMARKS / "gpu_draw.py"), *smoke_flag, *step_out("draw")],
            120,
            "*.json",
            {
                "draw_greedy_1_speedup": "cases.greedy_1.speedup",
                "draw_greedy_1_compiled_us": "cases.greedy_1.compiled_us",
                "draw_sampled_256_speedup": "cases.sampled_256.speedup",
            },
        ),
        Step(
            "skinny_sweep",
            [python, str(BENCHMARKS / "gpu_skinny_sweep.py"), *smoke_flag, *step_out("skinny_sweep")],
            150,
            "*.json",
            {
                "skinny_sweep_best_1.5b": "shapes.0.best",
                "skinny_sweep_saved_us_over_default_1.5b": "shapes.0.best_saved_us_per_28_layer_step_over_default",
                "skinny_sweep_saved_us_over_torch_1.5b": "shapes.0.best_saved_us_per_28_layer_step_over_torch",
                # The engine's down tiling with its split sum in the kernel (5) and in a kernel of its own (17).
                "skinny_sweep_down_us_sum_inside_1.5b": "shapes.0.projections.down.5.us",
                "skinny_sweep_down_us_sum_apart_1.5b": "shapes.0.projections.down.17.us",
                # ... and launched with programmatic dependent launch (18), against 5.
                "skinny_sweep_down_us_dependent_launch_1.5b": "shapes.0.projections.down.18.us",
            },
        ),
        Step(
            "paged_sweep",
            [python, str(BENCHMARKS / "gpu_paged_sweep.py"), *smoke_flag, *step_out("paged_sweep")],
            120,
            "*.json",
            {
                "paged_sweep_best_batch1_256": "regimes.batch1_256.best",
                "paged_sweep_speedup_batch1_256": "regimes.batch1_256.best_speedup_over_default",
                "paged_sweep_best_batch256": "regimes.batch256_1024.best",
                "paged_sweep_speedup_batch256": "regimes.batch256_1024.best_speedup_over_default",
                # The default (split-K combined in the kernel) against the combine kernel of its own (9).
                "paged_sweep_us_batch1_256_combine_inside": "regimes.batch1_256.configs.0.us",
                "paged_sweep_us_batch1_256_combine_apart": "regimes.batch1_256.configs.9.us",
                "paged_sweep_us_batch1_256_one_split": "regimes.batch1_256.configs.10.us",
                "paged_sweep_us_batch1_256_two_splits": "regimes.batch1_256.configs.11.us",
                "paged_sweep_us_batch1_256_dependent_launch": "regimes.batch1_256.configs.12.us",
            },
        ),
        Step(
            "g5",
            [python, str(BENCHMARKS / "gpu_reshard.py"), *large_model, *smoke_flag, *step_out("g5")],
            60,
            "*.json",
            {"G5_ratio_to_copy_bound": "results.*.ratio_to_copy_bound"},
        ),
        Step(
            "scale",
            [
                python,
                str(BENCHMARKS / "scale.py"),
                "--algo",
                "grpo",
                # On CPU (--smoke) two ranks on gloo: the sharded floors; one GPU holds one rank.
                *(["--smoke", "--nproc", "2", "--steps", "1", "--new-tokens", "4"] if smoke else ["--nproc", "1"]),
                *large_model,
                *step_out("scale"),
            ],
            150,
            "*.json",
            {"scale_worst_peak_over_floor": "worst_peak_over_floor"},
        ),
        Step(
            "cuda_tests_full",
            [*pytest, "-m", "gpu", "tests", f"--junitxml={work / 'cuda_tests_full.xml'}"],
            240,
        ),
        Step(
            "g2_static",
            [*generate, "--measure", "batch", "--baselines", "static", *step_out("g2_static")],
            420,
            "*.json",
            {"G2_speedup_over_static": "batch.static.speedup"},
        ),
        Step(
            "g3_rows",
            [
                python,
                str(BENCHMARKS / "gpu_update.py"),
                *large_model,
                *smoke_flag,
                "--token-budget",
                "null",
                *([] if smoke else ["--repeats", "2"]),
                *step_out("g3_rows"),
            ],
            150,
            "*.json",
            {"G3_rows_mfu": "per_length.0.mfu", "G3_rows_mfu_longest": "per_length.-1.mfu"},
        ),
        Step(
            "g3_eager",
            [
                python,
                str(BENCHMARKS / "gpu_update.py"),
                *large_model,
                *smoke_flag,
                "--compile",
                "off",
                *([] if smoke else ["--repeats", "2"]),
                *step_out("g3_eager"),
            ],
            150,
            "*.json",
            {"G3_eager_mfu": "per_length.0.mfu", "G3_eager_mfu_longest": "per_length.-1.mfu"},
        ),
        Step(
            "g3_selective",
            [
                python,
                str(BENCHMARKS / "gpu_update.py"),
                *large_model,
                *smoke_flag,
                "--activation-checkpointing",
                "selective",
                *([] if smoke else ["--repeats", "2"]),
                *step_out("g3_selective"),
            ],
            150,
            "*.json",
            {"G3_selective_mfu": "per_length.0.mfu", "G3_selective_mfu_longest": "per_length.-1.mfu"},
        ),
        Step(
            "g3_offload",
            [
                python,
                str(BENCHMARKS / "gpu_update.py"),
                *large_model,
                *smoke_flag,
                "--activation-offload",
                *([] if smoke else ["--repeats", "2"]),
                *step_out("g3_offload"),
            ],
            150,
            "*.json",
            {"G3_offload_mfu": "per_length.0.mfu", "G3_offload_mfu_longest": "per_length.-1.mfu"},
        ),
        Step(
            "moe",
            [
                python,
                str(BENCHMARKS / "moe_layer.py"),
                *(
                    ["--experts", "8", "--top-k", "2", "--tokens", "64", "--hidden", "256", "--expert-width", "128"]
                    if smoke
                    else ["--dtype", "bfloat16", "--tokens", "8192", "--repeats", "5"]
                ),
                *step_out("moe"),
            ],
            120,
            "*.json",
            {"moe_looped_over_grouped": "looped_over_grouped", "moe_grouped_gflops_per_s": "grouped_gflops_per_s"},
        ),
        Step(
            "two_process",
            [
                python,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                str(ROOT / "recipes" / "grpo.py"),
                *recipe_overrides,
            ],
            180,
        ),
    ]


STEPS = ("model", "cuda_tests", "g1", "g3", "g4", "g2", "kernels", "g5")
"""What a plain call runs, in this order: the goals' steps first (G1, G3, G4, G2: about 9 minutes with the model's
build and the CUDA tests on an H200), then ``kernels`` and ``g5`` (476 s of steps in all in session 37 on an H100, 627 s
in session 44 on an H200); see the module docstring for each step's limit."""
OPTIONAL = (
    "draw",
    "g1_skinny",
    "g1_cublas",
    "g1_pdl",
    "skinny_sweep",
    "paged_sweep",
    "g1_eager_blocks",
    "scale",
    "cuda_tests_full",
    "g2_static",
    "two_process",
    "moe",
    "g3_rows",
    "g3_eager",
    "g3_selective",
    "g3_offload",
)
"""Run only when named in ``--only``."""
MODEL_USERS = (
    "g1",
    "g1_skinny",
    "g1_cublas",
    "g1_pdl",
    "g1_eager_blocks",
    "g3",
    "g4",
    "g2",
    "g5",
    "scale",
    "g2_static",
    "g3_rows",
    "g3_eager",
    "g3_selective",
    "g3_offload",
)
"""Steps that read the models ``model`` builds."""


def dig(value, path: str):
    """``value`` followed along ``a.b.0`` (list indices may be negative, and a number that is not a dict's key indexes
    its values the same way; ``*`` is a dict's first value); None where the path does not exist."""
    for key in path.split("."):
        try:
            if key == "*":
                value = next(iter(value.values()))
            elif isinstance(value, dict) and key not in value and key.lstrip("-").isdigit():
                value = list(value.values())[int(key)]  # a dict's n-th value (-1: its last), as for a list
            else:
                value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError, AttributeError, StopIteration):
            return None
    return value


def junit_counts(path: Path) -> dict[str, int] | None:
    if not path.is_file():
        return None
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_step(step: Step, work: Path, remaining_s: float) -> dict:
    """Run one step under ``min(its limit, what is left of the budget)``; its status, time, output tail and figures."""
    if remaining_s < 10:
        return {"status": "skipped", "reason": "the suite's --budget-s ran out before this step"}
    limit = min(step.limit_s, remaining_s)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS), os.environ.get("PYTHONPATH", "")])}
    log = work / f"{step.name}.log"
    started = time.perf_counter()
    with open(log, "w") as output_file:
        # Its own process group: a step past its limit is killed whole, torchrun's ranks with it, so that nothing it
        # started holds the GPU while the next step runs.
        process = subprocess.Popen(
            step.command, cwd=ROOT, env=env, stdout=output_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = "passed" if process.wait(timeout=limit) == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timed_out"
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    output = log.read_text(errors="replace")
    record = {
        "status": status,
        "seconds": round(time.perf_counter() - started, 1),
        "limit_s": limit,
        "command": " ".join(step.command),
        "log": str(log),
        "output_tail": output[-3000:],
    }
    if step.json_glob:
        found = sorted((work / step.name).glob(step.json_glob))
        if found:
            record["result"] = json.loads(found[-1].read_text())
            record["figures"] = {name: dig(record["result"], path) for name, path in step.headline.items()}
    if step.name.startswith("cuda_tests"):
        record["tests"] = junit_counts(work / f"{step.name}.xml")
    return record


def only_the_models_read(model: Step, chosen: list[Step]) -> Step:
    """The ``model`` step building only the shapes the other ``chosen`` steps read (``--only g4`` reads the 0.5B, not
    the 1.5B: the cold build of both took 59 s of session 49's G4 call); all of them when no other step reads one."""
    commands = [" ".join(step.command) for step in chosen if step.name != "model"]
    shapes = model.command[2:]  # shape=directory, one per model
    read = [shape for shape in shapes if any(shape.split("=", 1)[1] in command for command in commands)]
    return replace(model, command=[*model.command[:2], *read]) if read else model


def table(report: dict) -> str:
    lines = [f"{'step':<12} {'status':<10} {'s':>7}  figures"]
    for name, record in report["steps"].items():
        figures = dict(record.get("figures") or {})
        if record.get("tests"):
            figures.update(record["tests"])
        shown = ", ".join(
            f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}" for key, value in figures.items()
        )
        seconds = f"{record['seconds']:.0f}" if "seconds" in record else "-"
        lines.append(f"{name:<12} {record['status']:<10} {seconds:>7}  {shown}")
    return "\n".join(lines)


def package_versions() -> dict[str, str | None]:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def stale_files() -> list[str]:
    """Files of the tree's package that the imported ``spmd_rlhf`` does not hold as they are here (an installed wheel
    older than the tree: ``benchmarks/gpu_wheels.sh`` was not run again after a change); empty when the tree itself is
    what is imported (an editable install) or the two agree."""
    import spmd_rlhf

    installed = Path(spmd_rlhf.__file__).resolve().parent
    if installed == ROOT / "src" / "spmd_rlhf":
        return []
    shipped = [*(ROOT / "src" / "spmd_rlhf").rglob("*.py"), *(ROOT / "kernels").glob("*.py")]
    shipped += [*(ROOT / "recipes").glob("*.py"), *(ROOT / "recipes" / "configs").glob("*.yaml")]  # as setup.py ships
    stale = []
    for path in sorted(shipped):
        relative = path.relative_to(ROOT / "src" / "spmd_rlhf") if path.is_relative_to(ROOT / "src") else None
        copy = installed / (relative or path.relative_to(ROOT))
        if not copy.is_file() or copy.read_bytes() != path.read_bytes():
            stale.append(str(path.relative_to(ROOT)))
    return stale


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): checks the suite, measures nothing")
    parser.add_argument("--only", nargs="+", help="run only these steps (STEPS and OPTIONAL), in the order named")
    parser.add_argument("--budget-s", type=float, default=550.0, help="wall-clock budget for all steps together")
    parser.add_argument("--work", default=str(DEFAULT_WORK), help="where the models and each step's files go")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    stale = stale_files()
    if stale:
        sys.exit(
            f"the installed spmd_rlhf is older than this tree ({len(stale)} files differ, e.g. {stale[:3]}): run "
            "`bash benchmarks/gpu_wheels.sh` here again before the GPU call"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    every = steps(sys.executable, args.smoke, work, out)
    unknown = set(args.only or ()) - {step.name for step in every}
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; the steps are {[step.name for step in every]}")
    by_name = {step.name: step for step in every}
    chosen = [by_name[name] for name in dict.fromkeys(args.only or STEPS)]
    wanted = [step.name for step in chosen]
    if "model" not in wanted and any(step.name in MODEL_USERS for step in chosen):
        chosen.insert(0, every[0])  # builds what is missing, in seconds where the models are there already
    chosen = [only_the_models_read(step, chosen) if step.name == "model" else step for step in chosen]
    report = {"smoke": args.smoke, "environment": environment(device), "versions": package_versions(), "steps": {}}
    path = out / f"gpu_suite_{device}{'_smoke' if args.smoke else ''}.json"
    for line in (f"{name} {found}" for name, found in report["versions"].items()):
        print(line, flush=True)
    deadline = time.perf_counter() + args.budget_s
    for step in chosen:
        print(f"== {step.name} (limit {step.limit_s} s): {' '.join(step.command)}", flush=True)
        record = report["steps"][step.name] = run_step(step, work, deadline - time.perf_counter())
        write_report(report, path)
        figures = ", ".join(f"{key} {value}" for key, value in (record.get("figures") or {}).items())
        print(f"   {record['status']} {record.get('seconds', '-')} s {figures}", flush=True)
        if record["status"] in ("failed", "timed_out"):
            print(record["output_tail"][-1500:], flush=True)
    if args.smoke:
        print("SMOKE RUN: not a GPU figure")
    print(table(report))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
