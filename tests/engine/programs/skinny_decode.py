"""Run under ``TRITON_INTERPRET=1`` (the kernels must be defined under the interpreter): the engine with its blocks'
projections through the skinny-linear Triton kernels, eager and compiled around attention (``aot_eager``), against
plain blocks on the same model. Prints one JSON line: the largest log-prob difference, whether tokens were equal, and
how many operator calls took the kernels (at most 4 rows) and how many fell back (prefill)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
from hf_fixtures import write_hf_model  # noqa: E402

import spmd_rlhf.kernels.skinny_linear as skinny_module  # noqa: E402
from spmd_rlhf.engine import LLMEngine, SamplingParams  # noqa: E402
from spmd_rlhf.engine.decode_graphs import compile_around_attention  # noqa: E402
from spmd_rlhf.engine.decode_matmul import use_skinny_linear  # noqa: E402
from spmd_rlhf.kernels.skinny_linear import MAX_ROWS  # noqa: E402
from spmd_rlhf.kernels.triton_support import INTERPRETING  # noqa: E402
from spmd_rlhf.models import load_model  # noqa: E402
from spmd_rlhf.models.merged_linear import merge_projections  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 40, 41], [70, 71, 72]]


class SkinnyCalls:
    """Counts the operator's calls by their row count, at most MAX_ROWS (the kernels) or more (F.linear), by wrapping
    the function its implementation calls (a dispatch mode would stop TorchDynamo from compiling)."""

    def __init__(self) -> None:
        self.kernel, self.fallback = 0, 0
        self.wrapped = skinny_module.skinny_linear

    def __call__(self, x, *args, **kwargs):
        if x.numel() // x.shape[-1] <= MAX_ROWS:
            self.kernel += 1
        else:
            self.fallback += 1
        return self.wrapped(x, *args, **kwargs)

    def __enter__(self):
        skinny_module.skinny_linear = self
        return self

    def __exit__(self, *exc) -> None:
        skinny_module.skinny_linear = self.wrapped


def generate(model_dir: str, *, skinny: bool, compiled: bool):
    model = load_model(model_dir, dtype=torch.float32).requires_grad_(False)
    merge_projections(model)
    per_block = use_skinny_linear(model, backend="triton") if skinny else None
    if compiled:
        compile_around_attention(model, backend="aot_eager")
    params = [
        SamplingParams(temperature=0, max_new_tokens=5),
        SamplingParams(temperature=1.0, max_new_tokens=4, seed=3),
    ]
    params.append(SamplingParams(temperature=0, max_new_tokens=3))
    with SkinnyCalls() as calls:
        outputs = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="static").generate(PROMPTS, params)
    return outputs, per_block, calls


def main() -> None:
    assert INTERPRETING, "run with TRITON_INTERPRET=1"
    model_dir = sys.argv[1]
    write_hf_model("qwen2_untied", model_dir)
    expected, _, _ = generate(model_dir, skinny=False, compiled=False)
    report = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        got, per_block, calls = generate(model_dir, skinny=True, compiled=compiled)
        report["compiled" if compiled else "eager"] = {
            "tokens_equal": [g.generated_token_ids for g in got] == [e.generated_token_ids for e in expected],
            "max_log_prob_difference": max(
                (torch.tensor(g.log_probs) - torch.tensor(e.log_probs)).abs().max().item()
                for g, e in zip(got, expected)
            ),
            "per_block": per_block,
            "kernel_calls": calls.kernel,
            "fallback_calls": calls.fallback,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
