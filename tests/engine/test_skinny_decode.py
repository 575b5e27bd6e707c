"""``rollout.decode_matmul=triton``: the generation copy's projections through the skinny-linear operator
(``engine.decode_matmul``), the kernels run under Triton's interpreter in a subprocess (they must be defined under it):
the same tokens and log-probs as ``F.linear`` blocks, eager and compiled around attention; and where it cannot run,
``F.linear`` with one log line saying why."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_fixtures import write_hf_model

import spmd_rlhf.kernels.skinny_linear as skinny_module
from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.engine import LLMEngine, SamplingParams, decode_matmul
from spmd_rlhf.engine.decode_compile import compile_around_attention
from spmd_rlhf.engine.decode_matmul import DEFAULT_TILINGS, skinny_linear_unsupported, use_skinny_linear
from spmd_rlhf.kernels.skinny_linear import SkinnyConfig
from spmd_rlhf.models import load_model
from spmd_rlhf.models.merged_linear import merge_projections

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from kernel_checks import interpreter_unusable_reason  # noqa: E402
from torchrun_helpers import torchrun  # noqa: E402

PROGRAM = Path(__file__).parent / "programs" / "skinny_decode.py"
PROMPTS = [[5, 6, 7, 8, 9], [70, 71, 72]]


@pytest.mark.skipif(interpreter_unusable_reason() is not None, reason=str(interpreter_unusable_reason()))
def test_the_kernels_decode_what_f_linear_decodes_eager_and_compiled(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(PROGRAM), str(tmp_path / "model")], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for blocks in ("eager", "compiled"):
        got = report[blocks]
        assert got["tokens_equal"] and got["max_log_prob_difference"] < 1e-5, report
        # Merged q/k/v, o, merged gate/up and down in every block, every block fused. A decode step (3 rows and
        # fewer) runs each block as two norm-linear kernels, o and the activation-linear; prefill (17 tokens) the
        # block's own pieces, each projection F.linear itself, never reaching the operators.
        assert got["per_block"] == 4 and got["fused_blocks"] == got["layers"]
        kernel, fallback = got["kernel_calls"], got["fallback_calls"]
        decode_steps = kernel["skinny_silu_mul_linear"] // got["layers"]
        assert decode_steps > 0 and kernel == {
            "skinny_linear": decode_steps * got["layers"],
            "skinny_norm_linear": 2 * decode_steps * got["layers"],
            "skinny_silu_mul_linear": decode_steps * got["layers"],
        }
        assert set(fallback.values()) == {0}
    # Both layers share each piece's graphs, now one for a single token, one for 2 to 4 rows (the fused pieces) and
    # one for more (the block's own): the first block's inputs, a later block's, its outputs, the final norm (1 and
    # many), the rotary tables (1, many, and the decode step's position buffer). A graph per layer would be more
    # (four layers, measured once: 14 too).
    assert report["compiled"]["graphs"] <= 14 and report["eager"]["graphs"] == 0


@pytest.mark.skipif(interpreter_unusable_reason() is not None, reason=str(interpreter_unusable_reason()))
def test_a_tensor_parallel_replica_on_local_shards_decodes_through_the_kernels(tmp_path, monkeypatch):
    """Two gloo ranks, one TP replica on local shards: the fused blocks on each rank's shards (o and down then
    summed over the group), eager and compiled around attention, decode what its F.linear blocks decode; a replica
    dispatching through DTensor is refused, naming run_locally."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the ranks are fresh interpreters: the kernels defined under it
    out = tmp_path / "results.json"
    finished = torchrun("tp_skinny_decode.py", str(out), nproc=2, timeout=240)
    assert finished.returncode == 0, finished.stdout[-6000:]
    report = json.loads(out.read_text())
    assert "run_locally" in report["refused_on_dtensor"] and report["taken_on_local_shards"] is None
    for blocks in ("eager", "compiled"):
        got = report[blocks]
        assert got["tokens_equal"] and got["max_log_prob_difference"] < 1e-5, report
        assert got["per_block"] == 4 and got["fused_blocks"] == 2  # both layers
        kernel = got["kernel_calls"]
        decode_steps = kernel["skinny_linear"] // 2  # o, once per layer and step
        assert (
            decode_steps > 0
            and kernel["skinny_norm_linear"] == 2 * kernel["skinny_silu_mul_linear"] == 4 * decode_steps
        )
    # The row-parallel all-reduces (o's and down's) traced into the compiled blocks' second piece.
    assert report["compiled"]["collective_graphs"] > 0 and report["eager"]["collective_graphs"] == 0


def test_every_projection_of_a_block_goes_through_the_operator(tmp_path, monkeypatch):
    write_hf_model("qwen2_untied", str(tmp_path))
    params = SamplingParams(temperature=0, max_new_tokens=4)
    expected = LLMEngine(load_model(str(tmp_path)), eos_token_id=None, block_size=4).generate(PROMPTS, params)
    plain = load_model(str(tmp_path))
    assert use_skinny_linear(plain, backend="torch") == (7, 0)  # q, k, v, o, gate, up, down; nothing to fuse
    merged = load_model(str(tmp_path)).requires_grad_(False)
    merge_projections(merged)
    assert use_skinny_linear(merged, backend="torch") == (4, merged.args.num_layers)
    for model in (plain, merged):
        got = LLMEngine(model, eos_token_id=None, block_size=4).generate(PROMPTS, params)
        assert [g.generated_token_ids for g in got] == [e.generated_token_ids for e in expected]
    calls = []
    for name in ("skinny_linear", "skinny_norm_linear", "skinny_silu_mul_linear"):
        wrapped = getattr(skinny_module, name)
        monkeypatch.setattr(
            skinny_module,
            name,
            lambda x, *args, wrapped=wrapped, name=name, **kwargs: calls.append(name) or wrapped(x, *args, **kwargs),
        )
    LLMEngine(merged, eos_token_id=None, block_size=4).generate(PROMPTS[:1], params)
    # 4 per block in each of 3 decode steps (the fused block); prefill's 5 rows are F.linear's, past the operators.
    assert len(calls) == 3 * merged.args.num_layers * 4
    assert calls.count("skinny_silu_mul_linear") == 3 * merged.args.num_layers
    # Each projection its own tiling (session 47's sweep), the fused block at one row: two rows of decode take the
    # block's own pieces, each projection F.linear itself.
    first, unmerged = (next(iter(m.model.layers.values())) for m in (merged, plain))
    projections = {
        "qkv": (first.self_attn.merged, unmerged.self_attn.k_proj),
        "o": (first.self_attn.o_proj, unmerged.self_attn.o_proj),
        "gate_up": (first.mlp.merged, unmerged.mlp.up_proj),
        "down": (first.mlp.down_proj, unmerged.mlp.down_proj),
    }
    for name, modules in projections.items():
        assert all(m.skinny_kernels[1] == DEFAULT_TILINGS[name].as_tiling() for m in modules), name
    assert first.skinny_rows == 1
    calls.clear()
    LLMEngine(merged, eos_token_id=None, block_size=4).generate(PROMPTS, params)
    assert calls == []
    with pytest.raises(ValueError, match="one per"):
        use_skinny_linear(plain, backend="torch", config={"qkv": SkinnyConfig()})


def test_a_second_engine_on_the_model_keeps_the_first_ones_compiled_pieces(tmp_path):
    """``benchmarks/gpu_generate.py`` builds a graphed and an eager engine on one model: the second must neither
    rebind the pieces the first compiled (session 48's H200 run decoded batch 64 with eager norms that way) nor
    compile them again."""
    write_hf_model("qwen2_untied", str(tmp_path))
    model = load_model(str(tmp_path)).requires_grad_(False)
    merge_projections(model)
    counts = use_skinny_linear(model, backend="torch")
    compile_around_attention(model, backend="aot_eager")
    layer = next(iter(model.model.layers.values()))
    pieces = (layer.attention_inputs, layer.residual_attention_inputs, layer.attention_outputs_apart)
    assert use_skinny_linear(model, backend="torch") == counts
    compile_around_attention(model, backend="aot_eager")
    assert (layer.attention_inputs, layer.residual_attention_inputs, layer.attention_outputs_apart) == pieces
    with pytest.raises(ValueError, match="other tilings"):
        use_skinny_linear(model, backend="torch", config=SkinnyConfig(num_warps=2))
    compiled_first = load_model(str(tmp_path)).requires_grad_(False)
    merge_projections(compiled_first)
    compile_around_attention(compiled_first, backend="aot_eager")
    with pytest.raises(ValueError, match="before compile_around_attention"):
        use_skinny_linear(compiled_first, backend="torch")


def test_where_the_kernels_cannot_run_the_engine_says_why_and_keeps_f_linear(tmp_path, caplog, monkeypatch):
    write_hf_model("qwen2_untied", str(tmp_path))
    model = load_model(str(tmp_path))
    assert "need CUDA tensors" in skinny_linear_unsupported(model)  # a TP replica: test_a_tensor_parallel_replica_...
    with caplog.at_level(logging.INFO, logger="spmd_rlhf.engine.decode_graphs"):
        engine = LLMEngine(model, eos_token_id=None, block_size=4)  # auto, the default: F.linear without a word
        assert caplog.text == "" and all("forward" not in vars(m) for m in model.model.layers.modules())
        engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_matmul="triton")
    assert "rollout.decode_matmul=triton falls back to F.linear" in caplog.text
    assert all("forward" not in vars(m) for m in engine.runner.model.model.layers.modules())
    # Where it can run (CUDA with triton), the engine points the blocks at the operator.
    monkeypatch.setattr(decode_matmul, "skinny_linear_unsupported", lambda model: None)
    tiling = SkinnyConfig(block_out=16, prefetch=True)
    LLMEngine(model, eos_token_id=None, block_size=4, decode_matmul="triton", decode_tiling=tiling)
    assert all("forward" in vars(layer.mlp.down_proj) for layer in model.model.layers.values())
    assert all(layer.mlp.down_proj.skinny_kernels[1] == tiling.as_tiling() for layer in model.model.layers.values())
    chosen = load_model(str(tmp_path))
    LLMEngine(chosen, eos_token_id=None, block_size=4)  # auto takes the kernels where they run
    assert all(layer.mlp.down_proj.skinny_kernels for layer in chosen.model.layers.values())
    with pytest.raises(ValueError, match="decode_matmul='cublas' is unknown"):
        LLMEngine(model, eos_token_id=None, block_size=4, decode_matmul="cublas")
    assert load_config(None, []).rollout.decode_matmul == "auto"
    with pytest.raises(ConfigError, match="rollout.decode_matmul"):
        load_config(None, ["rollout.decode_matmul=cublas"])
