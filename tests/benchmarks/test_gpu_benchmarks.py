"""The GPU suite (``benchmarks/gpu_suite.sh``) started cold, as on a bare GPU machine, in ``--smoke`` mode: a fresh
virtual environment that sees only the packages the GPU image holds (``IMAGE_PACKAGES``), the wheels
``benchmarks/gpu_wheels.sh`` builds, no index. Every step runs end to end on a tiny model on whatever device this
machine has, and each benchmark's JSON (inside the suite's one report) holds every figure, finite and consistent with
each other, names the device it ran on and never claims a GPU result. Speed itself is not asserted."""

from __future__ import annotations

import importlib.metadata
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
from gpu_suite import STEPS  # noqa: E402

SMOKE_STEPS = (*STEPS, "scale")
"""The plain call's steps and the scale step (optional on a GPU, where it takes two minutes), in the order named."""

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-
it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-
mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
"""The GPU image's Python packages (as the device tool's KINDS.md lists them, read there on 2026-11-17);
omegaconf, trl, datasets, dill, multiprocess and spmd_rlhf itself are not among them: they travel as wheels."""


CARRIED = ("omegaconf", "trl", "datasets", "dill", "multiprocess", "spmd-rlhf")
"""What ``gpu_wheels.sh`` carries: the image lacks these."""


def image_distributions() -> dict[str, importlib.metadata.Distribution]:
    """This machine's distributions that the image holds: ``IMAGE_PACKAGES`` and what they need here (this machine's
    versions may need packages the image's do not), never one of ``CARRIED``."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    installed = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    chosen: dict[str, importlib.metadata.Distribution] = {}
    waiting = [name for name in IMAGE_PACKAGES if name in installed]
    while waiting:
        name = waiting.pop()
        if name in chosen or name in CARRIED or name not in installed:
            continue
        chosen[name] = installed[name]
        for line in chosen[name].requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                waiting.append(canonicalize_name(requirement.name))
    return chosen


def image_environment(root: Path) -> Path:
    """A virtual environment under ``root`` whose Python sees, of this machine's packages, only
    ``image_distributions`` (links to them in one folder, put on its path by a ``.pth`` file): the GPU image's
    Python, as far as this machine can hold it. Returns its ``python``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    packages = root / "image_site"
    packages.mkdir()
    for distribution in image_distributions().values():
        for top in {file.parts[0] for file in distribution.files or () if file.parts[0] != ".."}:
            link, target = packages / top, Path(distribution.locate_file(top))
            if target.exists() and not link.exists() and top != "__pycache__":
                link.symlink_to(target)
    (site,) = (root / "venv").glob("lib/python*/site-packages")
    (site / "image.pth").write_text(f"{packages}\n")
    return root / "venv" / "bin" / "python"


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> dict:
    """``gpu_wheels.sh`` then ``gpu_suite.sh --smoke`` in the image's environment: the suite's report."""
    root = tmp_path_factory.mktemp("cold_start")
    wheels = root / "wheels"
    built = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_wheels.sh"), str(wheels)],
        cwd=ROOT,
        env={**os.environ, "WHEELS_PYTHON": f"{sys.version_info.major}.{sys.version_info.minor}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:]
    python = image_environment(root)
    for carried in ("omegaconf", "trl", "datasets", "spmd_rlhf"):  # the image's environment, not this machine's
        assert subprocess.run([python, "-c", f"import {carried}"], capture_output=True).returncode != 0, carried
    environment = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(root)),
        "OMP_NUM_THREADS": "1",
        "PYTHON": str(python),
        "SPMD_WHEELS": str(wheels),
        "SPMD_SITE": str(root / "site"),
    }
    finished = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_suite.sh"), "--smoke", "--only", *SMOKE_STEPS]
        + ["--work", str(root / "work"), "--out", str(root)],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stdout[-6000:]
    assert "SMOKE RUN: not a GPU figure" in finished.stdout
    return json.loads((root / f"gpu_suite_{DEVICE}_smoke.json").read_text())


def result_of(suite: dict, step: str) -> dict:
    """The JSON of one step of the suite, checked for what every benchmark's JSON says of itself."""
    record = suite["steps"][step]
    assert record["status"] == "passed", record["output_tail"]
    result = record["result"]
    assert result["smoke"] is True
    assert result["environment"]["device"] == DEVICE
    assert " --smoke" in result["environment"]["command"]
    return result


def assert_positive_finite(values: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(values[key], (int, float)) and math.isfinite(values[key]) and values[key] > 0, (
            key,
            values[key],
        )


def test_cold_start_runs_every_step_with_the_carried_wheels(suite):
    assert list(suite["steps"]) == list(SMOKE_STEPS)
    assert {name: record["status"] for name, record in suite["steps"].items()} == dict.fromkeys(SMOKE_STEPS, "passed")
    versions = suite["versions"]
    assert versions["spmd_rlhf"] and versions["omegaconf"] == "2.4.0" and versions["trl"] == "1.16.0"
    assert suite["steps"]["cuda_tests"]["tests"]["tests"] >= 5  # every one of FAST_CUDA_TESTS was collected


def test_generate_decode_and_batch(suite):
    decode = result_of(suite, "g1")["decode"]
    generate = result_of(suite, "g2")
    batch = generate["batch"]
    assert list(decode) == ["1", "3"]  # the smoke's --decode-batches
    for size, row in decode.items():
        assert row["batch"] == int(size)
        assert_positive_finite(row, "decode_tokens_per_s", "floor_tokens_per_s", "ratio_to_floor", "copy_bytes_per_s")
        element = torch.empty((), dtype=getattr(torch, generate["dtype"])).element_size()
        assert row["weight_bytes"] == generate["parameters"] * element
        floor = row["batch"] * row["copy_bytes_per_s"] / (row["weight_bytes"] + row["kv_bytes_per_step"])
        assert row["floor_tokens_per_s"] == pytest.approx(floor)
        assert row["ratio_to_floor"] == pytest.approx(row["decode_tokens_per_s"] / row["floor_tokens_per_s"])
        for mode in ("auto", "off"):
            assert row["seconds"][f"{mode}_to_last_token"] > row["seconds"][f"{mode}_to_first_token"]
        assert row["graphs_speedup"] == pytest.approx(row["decode_tokens_per_s"] / row["eager_tokens_per_s"])
        assert row["cuda_graphs"] == 0  # CPU: eager decode steps in both engines
        assert row["graph_eager_first_mismatch"] is None  # float32 on CPU: the same steps twice
        assert row["meets_goal"] is None
    assert decode["3"]["kv_bytes_per_step"] == 3 * decode["1"]["kv_bytes_per_step"] > 0
    assert_positive_finite(batch, "engine_s", "engine_tokens_per_s", "speedup")
    dynamic = batch["dynamic"]
    assert dynamic["speedup"] == batch["speedup"] == pytest.approx(dynamic["seconds"] / batch["engine_s"])
    assert "dynamic cache" in dynamic["baseline"] and "static" not in batch
    assert batch["engine_stats"]["generated_tokens"] == batch["batch"] * batch["new_tokens"]
    assert batch["meets_goal"] is None


def test_first_mismatch_names_the_row_and_position():
    from gpu_generate import first_mismatch

    assert first_mismatch([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_mismatch([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == {"row": 1, "position": 1}
    assert first_mismatch([[1, 2]], [[1, 2, 3]]) == {"row": 0, "position": 2}


def test_update_actor_mfu(suite):
    result = result_of(suite, "g3")
    assert [row["length"] for row in result["per_length"]] == [16, 24]
    for row in result["per_length"]:
        assert_positive_finite(row, "step_s", "tokens_per_s")
        assert row["tokens_per_step"] == row["rows"] * row["length"]
        assert row["mfu"] is None and row["meets_goal"] is None  # CPU: no known peak, so no MFU


def test_grpo_against_trl(suite):
    result = result_of(suite, "g4")
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
    ours = result["spmd_rlhf"]
    assert len(ours["compiled_graphs_per_step"]) == len(ours["compile_s_per_step"]) == config["steps"]
    assert all(graphs >= 0 for graphs in ours["compiled_graphs_per_step"]) and ours["recompile_reasons"] == []
    assert ours["profile"]["device_syncs"] is None  # CPU: nothing waits, and the table has no such section


def test_grpo_reads_the_profiled_steps_device_syncs(tmp_path):
    from gpu_grpo import device_syncs

    from spmd_rlhf.metrics.device_syncs import DeviceSyncs

    with DeviceSyncs(armed=False) as syncs:
        syncs.sites.update({"training/packing.py:150": 8, "engine/llm_engine.py:324": 512})
    table = tmp_path / "step_1.txt"
    table.write_text(f"== by self device time\n...\n== where the host waited for the device, by line\n{syncs.table()}")
    assert device_syncs(table) == 520


def test_grpo_keeps_the_recompile_reasons_of_its_log():
    from gpu_grpo import recompile_reasons

    prefix = "[rank0]:V1127 19:17:42.551000 21045 torch/_dynamo/guards.py:4760] [5/1] [__recompiles]"
    log = "\n".join(
        [
            "spmd_rlhf: 3 steps",
            f"{prefix} Recompiling function forward in decoder.py:128",
            f"{prefix}     triggered by the following guard failure(s):",
            f"{prefix}     - 5/0: GLOBAL_STATE changed: grad_mode ",
            f"{prefix} Recompiling function forward in decoder.py:128",
            f"{prefix}     - 5/0: GLOBAL_STATE changed: grad_mode ",
        ]
    )
    assert recompile_reasons(log) == [
        "Recompiling function forward in decoder.py:128",
        "- 5/0: GLOBAL_STATE changed: grad_mode",
    ]


def test_reshard_on_one_rank_reports_no_all_gather_ratio(suite):
    (row,) = result_of(suite, "g5")["results"].values()
    assert row["ratio_to_bound"] is None and row["meets_goal"] is None
    assert row["degenerate"].startswith("world size 1")
    assert_positive_finite(row, "ratio_to_copy_bound", "copy_bound_s", "copy_bytes_per_s", "naive_ratio")
    assert_positive_finite(row["seconds"], "to_generation", "naive")
    assert row["copy_bound_s"] == pytest.approx(row["copy_moved_bytes"] / row["copy_bytes_per_s"])


def test_scale_step_reports_every_stage_on_two_ranks(suite):
    """``benchmarks/scale.py`` in the suite (``--smoke`` on CPU: GRPO on two gloo ranks), every stage measured and
    given a floor."""
    from scale_floor import STAGES

    record = suite["steps"]["scale"]
    result = result_of(suite, "scale")
    assert result["nproc"] == 2 and result["algo"] == "grpo"
    assert record["figures"]["scale_worst_peak_over_floor"] == max(row["peak_over_floor"] for row in result["stages"])
    names = [stage["stage"] for stage in result["stages"]]
    assert names == [name for name in STAGES if name in names]
    assert {"load", "generate", "log_probs", "update", "save", "export", "resume"} <= set(names)
    for stage in result["stages"]:
        assert len(stage["peak_bytes_per_rank"]) == 2
        assert max(stage["peak_bytes_per_rank"]) == stage["peak_bytes"]
        assert stage["floor_bytes"] == pytest.approx(sum(stage["floor_parts"].values()))
        for key in ("floor_bytes", "peak_over_floor", "seconds"):
            assert math.isfinite(stage[key]) and stage[key] > 0, (stage["stage"], key, stage[key])
        assert stage["peak_over_floor"] == pytest.approx(stage["peak_bytes"] / stage["floor_bytes"])
        assert stage["design_floor_bytes"] == pytest.approx(stage["floor_bytes"] + sum(stage["design_parts"].values()))
        assert stage["peak_over_design_floor"] == pytest.approx(stage["peak_bytes"] / stage["design_floor_bytes"])
    # Building the model and the optimizer cannot leave a rank's memory where it was before the load.
    assert all(peak > 0 for peak in result["stages"][0]["peak_bytes_per_rank"])
    assert result["measurement"].startswith("RSS, freed blocks >= 64 KiB returned to the kernel")
    assert (
        "| stage | peak per rank (GiB) | floor (GiB) | peak / floor | floor + design buffers (GiB) | peak / that | "
        "whole-model copy? | rise in stage (GiB) | seconds |"
    ) in Path(record["log"]).read_text()


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


def test_kernels_at_real_sizes_script(suite):
    result = result_of(suite, "kernels")
    paged, fused = result["paged_decode"], result["fused_logprob"]
    assert_positive_finite(paged, "kernel_s", "reference_s", "speedup", "floor_s", "kernel_over_floor")
    assert paged["speedup"] == pytest.approx(paged["reference_s"] / paged["kernel_s"])
    assert paged["floor_s"] == pytest.approx(paged["kv_bytes"] / paged["copy_bytes_per_s"])
    (batch1,) = paged["batch1"].values()
    assert_positive_finite(
        batch1,
        "one_split_with_write_s",
        "split_k_with_write_s",
        "split_k_fused_write_s",
        "split_k_fused_write_and_rotation_s",
    )
    assert batch1["rotation_in_kernel_us_per_call"] == pytest.approx(
        (batch1["split_k_fused_write_and_rotation_s"] - batch1["split_k_fused_write_s"]) * 1e6
    )
    assert batch1["speedup"] == pytest.approx(batch1["one_split_with_write_s"] / batch1["split_k_fused_write_s"])
    assert_positive_finite(fused, "kernel_s", "reference_s", "speedup")
    assert paged["meets_goal"] is None and fused["meets_goal"] is None
    projections = result["skinny_linear"]["projections"]
    for figures in projections.values():
        assert_positive_finite(figures, "torch_us", "skinny_us", "speedup", "torch_over_copy", "skinny_over_copy")
    # At one row, the projections whose kernels take the block's elementwise work are timed with it too.
    with_prologue = {name for name, figures in projections.items() if "fused" in figures}
    assert with_prologue == {f"{shape}_{name}_rows1" for shape in ("1.5b", "7b") for name in ("qkv", "gate_up", "down")}
    for name in with_prologue:
        figures = projections[name]
        assert_positive_finite(figures, "fused_us")
        assert figures["prologue_us"] == pytest.approx(figures["fused_us"] - figures["skinny_us"])


def test_gpu_suite_reports_every_step_it_had_no_time_for(tmp_path):
    """A budget too small for any step reports every step as skipped instead of dropping it, in the suite's order."""
    finished = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--smoke", "--budget-s", "0", "--work", str(tmp_path)]
        + ["--out", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stdout[-4000:]
    report = json.loads((tmp_path / f"gpu_suite_{DEVICE}_smoke.json").read_text())
    assert list(report["steps"]) == list(STEPS)
    assert [record["status"] for record in report["steps"].values()] == ["skipped"] * len(STEPS)


def test_suite_digs_figures_out_of_nested_results():
    from gpu_suite import dig

    result = {"a": [{"x": 1}, {"x": 2}], "results": {"dp1": {"ratio": 0.5}}}
    assert dig(result, "a.-1.x") == 2 and dig(result, "results.*.ratio") == 0.5
    assert dig(result, "a.5.x") is None and dig(result, "missing.key") is None
    assert dig({"decode": {"1": {"r": 0.1}, "64": {"r": 0.7}}}, "decode.-1.r") == 0.7


def test_the_model_step_builds_only_the_models_the_chosen_steps_read(tmp_path):
    """``--only g4`` builds the 0.5B only, ``--only g1`` the 1.5B only, ``--only model`` both."""
    from gpu_suite import only_the_models_read, steps

    every = {step.name: step for step in steps("python", False, tmp_path, tmp_path)}

    def built(*names: str) -> list[str]:
        chosen = [every["model"], *(every[name] for name in names)]
        return [shape.split("=")[0] for shape in only_the_models_read(every["model"], chosen).command[2:]]

    assert built("g4") == ["0.5b"]
    assert built("g1", "g1_pdl") == ["1.5b"]
    assert built("g1", "g4") == built() == built("cuda_tests") == ["1.5b", "0.5b"]
