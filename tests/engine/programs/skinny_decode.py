"""Run under ``TRITON_INTERPRET=1`` (the kernels must be defined under the interpreter): the engine with its blocks'
projections through the skinny-linear Triton kernels, eager and compiled around attention (FX graphs run as traced,
counted), against
plain blocks on the same model. Prints one JSON line: the largest log-prob difference, whether tokens were equal, and
how many calls of each operator took the kernels (at most 4 rows) and how many fell back (prefill)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from counting_backend import CountingBackend  # noqa: E402
from hf_fixtures import write_hf_model  # noqa: E402

import spmd_rlhf.kernels.skinny_linear as skinny_module  # noqa: E402
from spmd_rlhf.engine import LLMEngine, SamplingParams  # noqa: E402
from spmd_rlhf.engine.decode_compile import compile_around_attention  # noqa: E402
from spmd_rlhf.engine.decode_matmul import use_skinny_linear  # noqa: E402
from spmd_rlhf.kernels.skinny_linear import MAX_ROWS, SkinnyConfig  # noqa: E402
from spmd_rlhf.kernels.triton_support import INTERPRETING  # noqa: E402
from spmd_rlhf.models import load_model  # noqa: E402
from spmd_rlhf.models.merged_linear import merge_projections  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 40, 41], [70, 71, 72]]
SHORT_PROMPT = [70, 71, 90]


FUNCTIONS = ("skinny_linear", "skinny_norm_linear", "skinny_silu_mul_linear")


class SkinnyCalls:
    """Counts the operators' calls of each function by their row count, at most MAX_ROWS (the kernels) or more
    (the torch reference), by wrapping the functions their implementations call (a dispatch mode would stop
    TorchDynamo from compiling)."""

    def __init__(self) -> None:
        self.kernel = dict.fromkeys(FUNCTIONS, 0)
        self.fallback = dict.fromkeys(FUNCTIONS, 0)
        self.wrapped = {name: getattr(skinny_module, name) for name in FUNCTIONS}

    def counting(self, name: str):
        def call(x, *args, **kwargs):
            counts = self.kernel if x.numel() // x.shape[-1] <= MAX_ROWS else self.fallback
            counts[name] += 1
            return self.wrapped[name](x, *args, **kwargs)

        return call

    def __enter__(self):
        for name in FUNCTIONS:
            setattr(skinny_module, name, self.counting(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, function in self.wrapped.items():
            setattr(skinny_module, name, function)


def generate(model_dir: str, *, skinny: bool, compiled: bool):
    model = load_model(model_dir, dtype=torch.float32).requires_grad_(False)
    merge_projections(model)
    # 32 outputs per program, a quarter of the default's programs for the interpreter to run (the default tiling is
    # kernel_checks.py's), and in the compiled blocks each tile's loads issued a tile ahead.
    tiling = SkinnyConfig(block_out=32, prefetch=compiled)
    swapped = use_skinny_linear(model, backend="triton", config=tiling) if skinny else None
    backend = CountingBackend()
    if compiled:
        compile_around_attention(model, backend=backend)
    params = [
        SamplingParams(temperature=0, max_new_tokens=5),
        SamplingParams(temperature=1.0, max_new_tokens=4, seed=3),
    ]
    params.append(SamplingParams(temperature=0, max_new_tokens=3))
    with SkinnyCalls() as calls:
        engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="static")
        outputs = engine.generate(PROMPTS, params)
        # A prompt of at most MAX_ROWS tokens: its prefill runs the fused pieces too, with the rotation.
        outputs += engine.generate([SHORT_PROMPT], [SamplingParams(temperature=0, max_new_tokens=3)])
    return outputs, swapped, calls, model.args.num_layers, backend.graphs


def main() -> None:
    assert INTERPRETING, "run with TRITON_INTERPRET=1"
    model_dir = sys.argv[1]
    write_hf_model("qwen2_untied", model_dir)
    expected, *_ = generate(model_dir, skinny=False, compiled=False)
    report = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        got, swapped, calls, layers, graphs = generate(model_dir, skinny=True, compiled=compiled)
        report["compiled" if compiled else "eager"] = {
            "tokens_equal": [g.generated_token_ids for g in got] == [e.generated_token_ids for e in expected],
            "max_log_prob_difference": max(
                (torch.tensor(g.log_probs) - torch.tensor(e.log_probs)).abs().max().item()
                for g, e in zip(got, expected)
            ),
            "per_block": swapped[0],
            "fused_blocks": swapped[1],
            "layers": layers,
            "graphs": graphs,
            "kernel_calls": calls.kernel,
            "fallback_calls": calls.fallback,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
