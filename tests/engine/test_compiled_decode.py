"""Decoder blocks compiled around their attention call for generation (``rollout.compile``,
``decode_compile.compile_around_attention``): the same tokens and log-probs as eager blocks through prefill and the
static decode step, a bounded number of graphs whatever the layer count, bucket or prompt length, and the key's wiring.

The graphs are traced here by a counting backend that runs TorchDynamo's FX graphs as they are (what ``aot_eager``
checks, without Inductor's code generation, which needs minutes of C++ compilation on CPU); Inductor on CUDA in
bfloat16 is ``test_cuda_compiled_layers_decode_like_eager_layers`` (the GPU suite's fast CUDA tests)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from hf_fixtures import write_hf_model

import spmd_rlhf.models.attention as attention
from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.engine import LLMEngine, SamplingParams, llm_engine
from spmd_rlhf.engine.decode_compile import compile_around_attention, compile_backend
from spmd_rlhf.kernels.paged_attention import PagedConfig, paged_decode_attention
from spmd_rlhf.models import load_model
from spmd_rlhf.models.merged_linear import merge_projections

sys.path.insert(0, str(Path(__file__).parent / "programs"))
from counting_backend import CountingBackend  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 40, 41], [70, 71, 72], [3, 4]]


def _requests() -> list[SamplingParams]:
    """Greedy and seeded sampled rows of different lengths: the batch shrinks through buckets 4, 2 and 1."""
    return [
        SamplingParams(temperature=0, max_new_tokens=3),
        SamplingParams(temperature=1.0, top_k=20, max_new_tokens=9, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, seed=2),
        SamplingParams(temperature=0, max_new_tokens=7),
    ]


@pytest.mark.parametrize("family", ["qwen2_untied", "qwen3"])
def test_compiled_layers_decode_what_eager_layers_decode(tmp_path, family):
    """Prefill and static decode steps through blocks compiled in two pieces, each block's last residual add carried
    into the next block's first piece and the last one's into the final norm: the same tokens and log-probs as eager
    blocks (QK-norm included), and every call through two graphs per piece at most (all layers share them),
    whatever the prompt lengths and the decode buckets."""
    torch._dynamo.reset()
    write_hf_model(family, str(tmp_path / "model"))
    eager_model = load_model(str(tmp_path / "model"), dtype=torch.float32)
    eager = LLMEngine(eager_model, eos_token_id=None, block_size=4, decode_graphs="static").generate(
        PROMPTS, _requests()
    )
    backend = CountingBackend()
    compiled_model = load_model(str(tmp_path / "model"), dtype=torch.float32)
    compile_around_attention(compiled_model, backend=backend)
    engine = LLMEngine(compiled_model, eos_token_id=None, block_size=4, decode_graphs="static")
    compiled = engine.generate(PROMPTS, _requests())
    for got, expected in zip(compiled, eager):
        assert got.generated_token_ids == expected.generated_token_ids
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(expected.log_probs), rtol=0, atol=1e-6)
    layers = compiled_model.args.num_layers
    steps = engine.stats.prefill_steps + engine.stats.decode_steps
    assert layers >= 2 and engine.stats.decode_steps > 1
    # Every block of every step ran both compiled pieces, the final norm took the last block's residual add, and the
    # rotary tables were compiled.
    assert compiled_model.model.carry_residuals
    assert backend.calls == (2 * layers + 2) * steps
    # The first block's inputs, a later block's (with the residual add), its outputs, the final norm, the rotary
    # tables: each for one token and for many (sizes of 1 are specialised). No graph more for the decode step's
    # position buffer: it is an inference tensor, as prefill's positions are (11 graphs when it was not).
    assert backend.graphs <= 10, backend.graphs


@pytest.mark.parametrize("family,merged", [("qwen2_untied", True), ("qwen3", False)])
def test_the_decode_kernel_rotates_what_the_layers_hand_it_unrotated(tmp_path, monkeypatch, family, merged):
    """Where the Triton decode kernel runs (its torch path here, as on CUDA otherwise), the layers hand it q and k
    unrotated with the step's rotary tables, and it rotates them: the same tokens and log-probs as the layers
    rotating them, through the merged q/k/v projection of the generation copy and the QK-norm path."""
    write_hf_model(family, str(tmp_path / "model"))

    def engine() -> LLMEngine:
        model = load_model(str(tmp_path / "model"), dtype=torch.float32).requires_grad_(False)
        if merged:
            merge_projections(model)
        return LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="static")

    expected = engine().generate(PROMPTS, _requests())
    tables = []

    def kernel(*args, rope=None, **kwargs):
        tables.append(rope)
        return paged_decode_attention(*args, rope=rope, backend="torch", **kwargs)

    monkeypatch.setattr(attention, "use_triton", lambda device, backend: True)
    monkeypatch.setattr(attention, "paged_decode_attention", kernel)
    decoding = engine()
    got = decoding.generate(PROMPTS, _requests())
    for row, reference in zip(got, expected):
        assert row.generated_token_ids == reference.generated_token_ids
        torch.testing.assert_close(torch.tensor(row.log_probs), torch.tensor(reference.log_probs), rtol=0, atol=1e-5)
    layers = decoding.runner.model.args.num_layers
    assert len(tables) == layers * decoding.stats.decode_steps > 0
    assert all(rope is not None for rope in tables)


@pytest.mark.parametrize("decode_graphs", ["static", "off"])
def test_the_engines_attention_tiling_reaches_every_decode_kernel_call(tmp_path, monkeypatch, decode_graphs):
    """``LLMEngine(attention_tiling=)``: every decode step's kernel call gets it, on the static step (graphs) and on
    the eager one."""
    write_hf_model("qwen2_untied", str(tmp_path / "model"))
    tiling, configs = PagedConfig(block_tokens=32, num_warps=8), []

    def kernel(*args, config, **kwargs):
        configs.append(config)
        return paged_decode_attention(*args, backend="torch", config=config, **kwargs)

    monkeypatch.setattr(attention, "use_triton", lambda device, backend: True)
    monkeypatch.setattr(attention, "paged_decode_attention", kernel)
    model = load_model(str(tmp_path / "model"), dtype=torch.float32)
    engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs=decode_graphs, attention_tiling=tiling)
    engine.generate(PROMPTS, _requests())
    assert len(configs) == model.args.num_layers * engine.stats.decode_steps > 0
    assert set(configs) == {tiling}


def test_the_rollout_compile_key_picks_the_backend_and_the_engine_applies_it(tmp_path, monkeypatch):
    assert compile_backend("off", graphs=True) is None
    assert compile_backend("auto", graphs=False) is None  # eager decode steps: nothing to fuse before a capture
    assert compile_backend("auto", graphs=True) == "inductor"
    assert compile_backend("on", graphs=False) == "inductor"
    with pytest.raises(ValueError, match="rollout.compile='yes' is unknown"):
        compile_backend("yes", graphs=True)
    assert load_config(None, []).rollout.compile == "auto"
    with pytest.raises(ConfigError, match="rollout.compile"):
        load_config(None, ["rollout.compile=always"])

    compiled = []
    monkeypatch.setattr(llm_engine, "compile_around_attention", lambda model, backend: compiled.append(backend))
    write_hf_model("qwen2_untied", str(tmp_path / "model"))
    model = load_model(str(tmp_path / "model"), dtype=torch.float32)
    for setting in ("off", "auto", "on"):
        LLMEngine(model, eos_token_id=None, block_size=4, compile_layers=setting)
    assert compiled == ["inductor"]  # "auto" on CPU: no CUDA graphs, so eager blocks


def test_the_static_steps_draws_run_compiled(tmp_path, monkeypatch):
    """With ``rollout.compile`` on, every decode step on the static step draws through the compiled
    ``sampler.draw_rows`` (once per step; greedy batches, and batches with sampled and top-k / top-p rows) and
    decodes what the eager draw decodes: at most two graphs per sampling kind (one row, any other count; the mixed
    batch's kind is filtered throughout), each holding the uniforms' float64 view of the step's integer buffer.
    Traced, the draw takes its argmax in two levels (``sampler.argmax_in_chunks``: Inductor never splits an argmax);
    eagerly, torch's own."""
    torch._dynamo.reset()
    backend = CountingBackend()
    monkeypatch.setattr(llm_engine, "compile_backend", lambda setting, graphs: backend if setting == "on" else None)
    monkeypatch.setattr(llm_engine, "compile_around_attention", lambda model, backend: None)
    write_hf_model("qwen2_untied", str(tmp_path / "model"))
    model = load_model(str(tmp_path / "model"), dtype=torch.float32)
    greedy = [SamplingParams(temperature=0, max_new_tokens=n) for n in (3, 9, 5, 7)]
    for requests in (greedy, _requests()):
        outputs, steps = {}, {}
        for setting in ("off", "on"):
            engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="static", compile_layers=setting)
            calls = backend.calls
            outputs[setting] = engine.generate(PROMPTS, requests)
            steps[setting] = (engine.stats.decode_steps, backend.calls - calls)
        for got, expected in zip(outputs["on"], outputs["off"]):
            assert got.generated_token_ids == expected.generated_token_ids
            assert got.log_probs == expected.log_probs and got.sampling_log_probs == expected.sampling_log_probs
        assert steps["off"][1] == 0
        assert steps["on"][0] > 3 and steps["on"][1] == steps["on"][0]
    assert backend.graphs <= 4
    # Each graph takes its chunks' maxima (``max`` over the chunked view), which the eager draw never calls.
    assert backend.targets["max"] >= backend.graphs


def test_a_draw_the_backend_cannot_compile_runs_eagerly_and_says_so(tmp_path, monkeypatch, caplog):
    """A compiler failure on the draw (first met in a step's warm-up) is logged once and the eager draw serves:
    the same tokens and log-probs as an engine that never compiled it."""
    torch._dynamo.reset()

    def failing(graph, example_inputs):
        raise RuntimeError("this backend compiles nothing")

    monkeypatch.setattr(llm_engine, "compile_backend", lambda setting, graphs: failing if setting == "on" else None)
    monkeypatch.setattr(llm_engine, "compile_around_attention", lambda model, backend: None)
    write_hf_model("qwen2_untied", str(tmp_path / "model"))
    model = load_model(str(tmp_path / "model"), dtype=torch.float32)
    outputs = {}
    for setting in ("off", "on"):
        engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="static", compile_layers=setting)
        with caplog.at_level(logging.WARNING, logger="spmd_rlhf.engine.decode_compile"):
            outputs[setting] = engine.generate(PROMPTS, _requests())
    for got, expected in zip(outputs["on"], outputs["off"]):
        assert got.generated_token_ids == expected.generated_token_ids and got.log_probs == expected.log_probs
    assert caplog.text.count("the decode step's draw runs eagerly") == 1
    assert "this backend compiles nothing" in caplog.text


def greedy_shortfall_and_log_prob_error(reference, outputs) -> tuple[float, float]:
    """The rows' generated tokens scored by ``reference`` (teacher-forced, its own precision): how far each token's
    log-prob falls below the best token's at its position (0 for greedy tokens) and how far the engine's reported
    log-probs are from the reference's, the largest of each over every row and step."""
    shortfall, error = 0.0, 0.0
    device = next(reference.parameters()).device
    for seq in outputs:
        ids = torch.tensor([seq.token_ids], device=device)
        with torch.no_grad():
            log_probs = torch.log_softmax(reference(ids)[0, seq.num_prompt_tokens - 1 : -1].float(), dim=-1)
        chosen = log_probs.gather(1, ids[0, seq.num_prompt_tokens :, None])[:, 0]
        shortfall = max(shortfall, (log_probs.max(dim=-1).values - chosen).max().item())
        error = max(error, (torch.tensor(seq.log_probs, device=device) - chosen).abs().max().item())
    return shortfall, error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_layers_decode_like_eager_layers(tmp_path):
    """On CUDA in bfloat16, Inductor's fused blocks inside the captured decode graphs decode greedily and report the
    log-probs of the same model in float32 (teacher-forced on the tokens they chose), as closely as eager blocks do,
    and graphs are captured.

    Not token equality with eager blocks: the tiny random model's logits are nearly flat, and bfloat16 rounding in a
    different kernel order parts near-ties (on an H200 a row's fourth token: 19 against 38), so each token is held
    to be the float32 model's best up to bfloat16's rounding instead."""
    torch._dynamo.reset()
    write_hf_model("qwen2_untied", str(tmp_path / "model"))
    reference = load_model(str(tmp_path / "model"), dtype=torch.float32, device=torch.device("cuda"))
    params = [SamplingParams(temperature=0, max_new_tokens=8) for _ in PROMPTS]
    measured = {}
    for setting in ("off", "on"):
        model = load_model(str(tmp_path / "model"), dtype=torch.bfloat16, device=torch.device("cuda"))
        engine = LLMEngine(model, eos_token_id=None, block_size=16, compile_layers=setting)
        outputs = engine.generate(PROMPTS, params)
        assert engine.stats.cuda_graphs > 0
        assert all(len(seq.generated_token_ids) == 8 for seq in outputs)
        measured[setting] = greedy_shortfall_and_log_prob_error(reference, outputs)
    for setting, (shortfall, error) in measured.items():
        assert shortfall < 0.05, (setting, measured)
        assert error < 0.1, (setting, measured)
