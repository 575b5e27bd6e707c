"""What the GPU benchmarks (``benchmarks/gpu_*.py``) share: the model shapes they run, the random-init model directory,
the device facts every result records (name, versions, measured copy bandwidth, peak FLOP/s), ``--smoke`` handling
and the JSON writer. As a script it builds models for the suite (``benchmarks/gpu_suite.py``'s ``model`` step):

    python benchmarks/gpu_common.py 1.5b=/tmp/spmd_gpu_suite/model_1.5b 0.5b=/tmp/spmd_gpu_suite/model_0.5b

Every figure a GPU benchmark reports is a ratio to a baseline measured in the same run. ``--smoke`` runs the same code
on a tiny model with small sizes (on CPU when there is no GPU, in seconds; ``tests/benchmarks`` runs it), and the JSON
then says ``"smoke": true`` and names the device it ran on: a smoke figure is never a GPU figure, and ``meets_goal``
is only set (true or false) for a run on CUDA without ``--smoke``; elsewhere it is null.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from spmd_rlhf.metrics.profiling import profiled  # noqa: F401  (re-exported: the benchmarks' --profile)

SHAPES: dict[str, dict[str, int | bool | None]] = {
    # Qwen2.5 shapes, vocabulary padded past the tokenizer like the real checkpoints'; 0.5B and 1.5B tie the embedding
    # and the LM head (qwen2's make_tiny default), 7B and 14B do not.
    "14b": dict(
        hidden_size=5120,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        intermediate_size=13824,
        model_vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "7b": dict(
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        intermediate_size=18944,
        model_vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        intermediate_size=8960,
        model_vocab_size=151936,
        max_position_embeddings=32768,
    ),
    "0.5b": dict(
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        intermediate_size=4864,
        model_vocab_size=151936,
        max_position_embeddings=32768,
    ),
    # Qwen3-30B-A3B's widths (48 layers of 128 experts, 8 per token, each 768 wide; 32 query and 4 key/value heads),
    # but heads of 64 dims where the real ones have 128 (make_tiny keeps hidden = heads x head_dim); --experts in
    # scale.py keeps fewer experts where memory requires.
    "30b-a3b": dict(
        family="qwen3_moe",
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        model_vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    # For --smoke: the tokenizer's own few hundred tokens.
    "smoke": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        model_vocab_size=None,
        max_position_embeddings=4096,
    ),
}
_CONFIG_KEYS = {  # SHAPES key -> config.json key, for checking a reused --model-dir
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "model_vocab_size": "vocab_size",
    "tie_word_embeddings": "tie_word_embeddings",
    "num_experts": "num_experts",
}

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, matched against torch.cuda.get_device_name in this order.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


# ---- models ------------------------------------------------------------------------------------------------------


def shape_fields(
    shape: str, *, layers: int | None = None, experts: int | None = None, vocab: int | None = None
) -> dict[str, int | bool | None]:
    """``make_tiny``'s arguments for ``shape`` (``family`` among them: qwen2 unless the shape names another), with
    ``layers`` decoder layers instead of the shape's own if given (real widths and vocabulary, fewer layers: what
    grows per layer and what per vocabulary row), ``vocab`` vocabulary rows instead of its own, and, for a
    mixture-of-experts shape, ``experts`` routed experts."""
    fields = {"family": "qwen2", **SHAPES[shape]}
    if layers is not None:
        fields["num_layers"] = layers
    if vocab is not None:
        fields["model_vocab_size"] = vocab
    if experts is not None:
        if "num_experts" not in fields:
            raise ValueError(f"--experts {experts}: the {shape} shape is dense; give a mixture-of-experts shape")
        fields["num_experts"] = experts
    return fields


def _check_shape(model_dir: str, shape: str, fields: dict[str, int | bool | None]) -> None:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key, config_key in _CONFIG_KEYS.items():
        wanted = fields.get(key)
        if wanted is not None and config.get(config_key) != wanted:
            raise ValueError(
                f"--model-dir {model_dir} holds a model with {config_key}={config.get(config_key)}, not the {shape} "
                f"shape's {wanted}; give an empty or new directory (it is built there) or the matching --shape"
            )


@contextmanager
def shaped_model(
    shape: str,
    model_dir: str | None = None,
    *,
    seed: int = 0,
    layers: int | None = None,
    experts: int | None = None,
    vocab: int | None = None,
) -> Iterator[str]:
    """The directory of a random-init model of ``shape`` (``SHAPES``: qwen2 or the family it names, with ``layers``
    layers and ``experts`` experts if given; ``shape_fields``) with
    ``make_tiny``'s tokenizer: built in a temporary directory removed afterwards, or in ``model_dir`` and kept there
    (a directory that already holds a model of that shape is used as it is, so several benchmarks can share one
    build). ``make_tiny`` builds the whole model in float32 in host memory once: 4 bytes per parameter."""
    from spmd_rlhf.tiny.model import make_tiny  # transformers and the models: seconds a launcher need not import

    fields = shape_fields(shape, layers=layers, experts=experts, vocab=vocab)
    if model_dir is None:
        with tempfile.TemporaryDirectory(prefix=f"gpu_bench_{shape}_") as scratch:
            yield make_tiny(out_dir=scratch, seed=seed, **fields)
        return
    if (Path(model_dir) / "config.json").is_file():
        _check_shape(model_dir, shape, fields)
    else:
        make_tiny(out_dir=model_dir, seed=seed, **fields)
    yield model_dir


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters, a tied embedding once: what one decode step must read from memory."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---- device ------------------------------------------------------------------------------------------------------


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def kernel_dtype(device: torch.device | str) -> torch.dtype:
    """The kernel benchmarks' dtype: bfloat16 on CUDA, float32 where the torch paths stand in for the kernels."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--repeats`` and ``--out``, as every kernel benchmark takes them."""
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def known_peak_tflops(name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``name`` (``torch.cuda.get_device_name``), None if not known."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def peak_tflops(device: torch.device | str, given: float | None) -> float | None:
    """``given`` (``--peak-tflops``), else the dense bf16 peak of a known GPU by name, else None (MFU not reported)."""
    if given is not None:
        return given
    return known_peak_tflops(device_name(device)) if torch.device(device).type == "cuda" else None


def copy_bandwidth(device: torch.device | str, *, nbytes: int, repeats: int = 5, copies: int = 10) -> float:
    """Bytes read plus bytes written per second by device-to-device copies of ``nbytes`` (best of ``repeats`` runs of
    ``copies`` back-to-back copies, after a warm-up, so that one synchronisation is small next to a run): the memory
    bandwidth a bandwidth-bound kernel can actually get."""
    source = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(copies):
            target.copy_(source)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / copies)
    return 2 * source.numel() * source.element_size() / best


# ---- arguments and results ---------------------------------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser, *, default_shape: str) -> None:
    """``--shape`` and ``--model-dir``, which every GPU benchmark takes (see ``shaped_model``)."""
    parser.add_argument("--shape", default=default_shape, choices=sorted(SHAPES))
    parser.add_argument("--model-dir", help="build the model here and keep it (or reuse one of the same shape)")


def parse_with_smoke(parser: argparse.ArgumentParser, smoke_defaults: dict) -> argparse.Namespace:
    """Parse the command line; with ``--smoke``, ``smoke_defaults`` replace the defaults (flags given still win)."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model and sizes (seconds on CPU): checks the script, measures nothing of interest",
    )
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**smoke_defaults)
        args = parser.parse_args()
    return args


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> dict:
    """Where and how a result was measured, with the command that measured it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Set by torchrun's agent (launch() sets RANK and friends itself for a plain one-process run).
    launcher = f"torchrun --nproc-per-node {world}" if "TORCHELASTIC_RUN_ID" in os.environ else "python"
    return {
        "device": torch.device(device).type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _package_version("transformers"),
        "triton": _package_version("triton"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "world_size": world,
        "command": f"{launcher} {shlex.join(sys.argv)}",
    }


def meets_goal(achieved: float | None, goal: float, *, at_least: bool, real_run: bool) -> bool | None:
    """Whether ``achieved`` reaches ``goal``; None for a smoke or CPU run, whose figures say nothing about the GPU."""
    if not real_run or achieved is None:
        return None
    return achieved >= goal if at_least else achieved <= goal


def write_result(out_dir: str, name: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"wrote {path}")
    return path


def run_workers(script: str, arguments: list[str], *, nproc: int = 2) -> dict:
    """``script --worker <arguments> --out=<file>`` under torchrun on ``nproc`` CPU ranks of one OpenMP thread each
    (a benchmark that runs itself as its own ranks); returns the JSON its rank 0 wrote to ``--out``."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="workers_") as scratch:
        out = f"{scratch}/result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            script,
            "--worker",
            *arguments,
            f"--out={out}",
        ]
        root = Path(__file__).resolve().parents[1]
        subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=root)
        return json.loads(Path(out).read_text())


def main() -> None:
    """Build each ``SHAPE=DIR`` of the command line (``shaped_model``: a directory holding that shape is kept)."""
    for spec in sys.argv[1:]:
        shape, _, directory = spec.partition("=")
        if shape not in SHAPES or not directory:
            sys.exit(f"give SHAPE=DIR with SHAPE one of {sorted(SHAPES)}, not {spec!r}")
        started = time.perf_counter()
        with shaped_model(shape, directory):
            print(f"{shape} model in {directory} ({time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
