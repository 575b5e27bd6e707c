"""An engine kept across RL steps: after the weights change in place (as the reshard writes them), the same engine,
runner, static decode step, buffers and cache run the next call, nothing is captured again, and the outputs equal a
fresh engine's on the new weights. CUDA graphs exist only on CUDA, so here a stand-in for a graph records every address
a captured step reads and checks them at each replay: what a real graph would silently read stale."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams, decode_graphs
from spmd_rlhf.engine.decode_graphs import StaticDecodeStep
from spmd_rlhf.models import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [70, 71, 72], [3, 4], [90] * 17]
PARAMS = [
    SamplingParams(temperature=0, max_new_tokens=6),
    SamplingParams(temperature=1.0, top_k=20, max_new_tokens=9, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, seed=2),
    SamplingParams(temperature=0, max_new_tokens=8),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    write_hf_model("qwen2_untied", path)
    return path


def captured_addresses(step: StaticDecodeStep) -> dict[str, int]:
    """Every storage a captured decode step reads or writes: the weights, the cache, the input buffers and outputs."""
    tensors = {f"model.{name}": tensor for name, tensor in step.model.state_dict(keep_vars=True).items()}
    tensors |= {"key_cache": step.key_cache, "value_cache": step.value_cache}
    for name in ("input_ids", "vectors", "sampling", "context_lens", "block_tables", "cu_seqlens_q"):
        tensors[name] = getattr(step, name)
    tensors |= {f"samples.{key}": samples for key, samples in step.samples.items()}
    return {name: tensor.data_ptr() for name, tensor in tensors.items()}


@pytest.fixture
def recorded_graphs(replayed_graphs, monkeypatch):
    """``replayed_graphs`` (conftest.py) whose replays first check that every address the capture read is still where
    it was."""
    capture = StaticDecodeStep._capture  # the stand-in capture replayed_graphs installed

    def capture_recorded(step: StaticDecodeStep, key: tuple[int, int]) -> None:
        capture(step, key)
        graph, addresses = step.graphs[key], captured_addresses(step)
        replay = graph.replay

        def checked_replay() -> None:
            now = captured_addresses(step)
            assert {name: now[name] for name in addresses} == addresses, "a captured address moved"
            replay()

        graph.replay = checked_replay

    monkeypatch.setattr(StaticDecodeStep, "_capture", capture_recorded)


def _engine(model, mode: str) -> LLMEngine:
    return LLMEngine(
        model, eos_token_id=None, block_size=4, num_blocks=48, max_num_seqs=4, decode_graphs=mode, max_model_len=40
    )


def _outputs(seqs) -> tuple[list, list]:
    return [seq.generated_token_ids for seq in seqs], [seq.log_probs for seq in seqs]


def test_a_kept_engine_replays_its_captures_after_a_weight_change_and_equals_a_fresh_engine(
    model_path, recorded_graphs
):
    model = load_model(model_path, dtype=torch.float32)
    engine = _engine(model, "auto")
    before = _outputs(engine.generate(PROMPTS, PARAMS))
    runner, step = engine.runner, engine.runner.static_step
    assert engine.stats.cuda_graph_captures == engine.stats.cuda_graphs >= 3  # buckets 4, 2 and 1 at least
    addresses = captured_addresses(step)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the reshard's in-place write of new weights
        for param in model.parameters():
            param.copy_(param + 0.05 * torch.randn(param.shape, generator=generator))
    after = engine.generate(PROMPTS, PARAMS)
    assert engine.runner is runner and runner.static_step is step and captured_addresses(step) == addresses
    assert engine.stats.cuda_graph_captures == 0 and engine.stats.cuda_graphs == len(step.graphs)
    tokens, log_probs = _outputs(after)
    fresh_tokens, fresh_log_probs = _outputs(_engine(model, "off").generate(PROMPTS, PARAMS))
    assert tokens == fresh_tokens and tokens != before[0]
    torch.testing.assert_close(
        torch.tensor([p for row in log_probs for p in row]),
        torch.tensor([p for row in fresh_log_probs for p in row]),
        rtol=0,
        atol=1e-5,
    )


def test_without_max_model_len_a_longer_call_prepares_and_captures_again(model_path, recorded_graphs):
    model = load_model(model_path, dtype=torch.float32)
    engine = LLMEngine(model, eos_token_id=None, block_size=4, num_blocks=48, decode_graphs="auto")
    engine.generate(PROMPTS[:1], PARAMS[:1])
    step = engine.runner.static_step
    engine.generate(PROMPTS, PARAMS)  # more rows than the first call prepared
    assert engine.runner.static_step is not step and engine.stats.cuda_graph_captures > 0


def test_why_graphs_are_off_is_logged_once(model_path, monkeypatch, caplog):
    monkeypatch.setattr(decode_graphs, "_said", set())
    model = load_model(model_path, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger=decode_graphs.__name__):
        for _ in range(2):
            LLMEngine(model, eos_token_id=None, block_size=4)
    assert [record.getMessage() for record in caplog.records] == [
        "decode steps run eagerly, without CUDA graphs: the model is on cpu, not a CUDA device"
    ]


def test_a_decode_step_past_the_prepared_width_runs_eagerly_and_says_so(model_path, monkeypatch, caplog):
    monkeypatch.setattr(decode_graphs, "_said", set())
    model = load_model(model_path, dtype=torch.float32)
    static = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="static", max_model_len=8)
    with caplog.at_level(logging.INFO, logger=decode_graphs.__name__):
        got = static.generate(PROMPTS, PARAMS)  # every prompt but one outgrows 8 tokens
    expected = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs="off").generate(PROMPTS, PARAMS)
    assert [seq.generated_token_ids for seq in got] == [seq.generated_token_ids for seq in expected]
    messages = [record.getMessage() for record in caplog.records]
    assert (
        len(messages) == 1
        and "runs eagerly, without CUDA graphs: the static decode step holds 256 rows of 2" in (messages[0])
    )
