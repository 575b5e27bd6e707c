"""Decode steps on fixed-address padded inputs (what CUDA graphs capture and replay) against eager decode steps: the
same tokens and log-probs, whatever the batch size bucket, padding, preemption or sampling; and on CUDA the graphs."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine.decode_graphs import StaticDecodeStep, decode_buckets, graphs_unsupported
from spmd_rlhf.engine.model_runner import ModelRunner
from spmd_rlhf.engine.sampler import FILTERED, GREEDY, SAMPLED
from spmd_rlhf.models import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [70, 71, 72], [3, 4], [90] * 17]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    write_hf_model("qwen2_untied", path)
    return path


def _requests() -> list[SamplingParams]:
    """Mixed greedy and sampled rows whose lengths differ, so the batch shrinks through several buckets (5 rows pad to
    8, then 4, 3 and 2 rows, then 1)."""
    return [
        SamplingParams(temperature=0, max_new_tokens=3),
        SamplingParams(temperature=1.0, top_k=20, max_new_tokens=11, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6, seed=2),
        SamplingParams(temperature=0, max_new_tokens=9),
        SamplingParams(temperature=1.0, max_new_tokens=14, seed=3),
    ]


def _generate(model, mode: str, **engine_args) -> tuple[list, LLMEngine]:
    engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs=mode, **engine_args)
    return engine.generate(PROMPTS, _requests()), engine


def test_buckets_cover_every_batch_size_with_little_padding():
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, *range(64, 256, 32), 256]
    assert decode_buckets(1) == [1] and decode_buckets(3) == [1, 2, 3] and decode_buckets(40)[-2:] == [32, 40]
    with pytest.raises(ValueError, match="max_rows=0"):
        decode_buckets(0)


@pytest.mark.parametrize("engine_args", [{}, {"num_blocks": 12, "max_num_seqs": 3}], ids=["roomy", "preempting"])
def test_static_decode_equals_eager_decode(model_path, engine_args, monkeypatch):
    model = load_model(model_path, dtype=torch.float32)
    eager, _ = _generate(model, "off", **engine_args)
    batch_sizes = []
    run = StaticDecodeStep.run
    monkeypatch.setattr(
        StaticDecodeStep,
        "run",
        lambda step, seqs, **sampling: batch_sizes.append(len(seqs)) or run(step, seqs, **sampling),
    )
    static, engine = _generate(model, "static", **engine_args)
    assert len(batch_sizes) == engine.stats.decode_steps > 0 and engine.stats.cuda_graphs == 0  # no capture off CUDA
    if engine_args:
        assert engine.num_preemptions > 0
    else:
        assert {5, 4, 3, 2, 1} <= set(batch_sizes)  # padded to 8, 4, 4 (one padding row), 2 and 1 rows
    for got, expected in zip(static, eager):
        assert got.generated_token_ids == expected.generated_token_ids
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(expected.log_probs), rtol=0, atol=1e-5)


def test_the_captured_step_samples_what_the_eager_step_samples(model_path, replayed_graphs):
    """Greedy rows and seeded rows of different temperatures, top-k and top-p in one batch, decoded by the captured
    step (trunk, LM head and sampler, replayed through the CPU stand-in for a graph): the same tokens and both
    log-probs as eager steps. As rows end, the batch's sampling kind goes from filtered to sampled to greedy, and each
    (batch size, kind) gets its own graph."""
    model = load_model(model_path, dtype=torch.float32)
    params = [
        SamplingParams(temperature=0, max_new_tokens=14),
        SamplingParams(temperature=1.3, top_k=20, max_new_tokens=5, seed=1),
        SamplingParams(temperature=0.7, top_k=30, top_p=0.9, max_new_tokens=7, seed=2),
        SamplingParams(temperature=0.5, top_k=10**6, max_new_tokens=10, seed=3),  # top_k past the vocabulary: no filter
        SamplingParams(temperature=1.0, max_new_tokens=9),  # the engine's seed
    ]
    outputs = {}
    for mode in ("off", "auto"):
        engine = LLMEngine(model, eos_token_id=None, block_size=4, decode_graphs=mode, seed=5)
        outputs[mode] = engine.generate(PROMPTS, params)
    assert {kind for _, kind in engine.runner.static_step.graphs} == {GREEDY, SAMPLED, FILTERED}
    assert engine.stats.cuda_graphs == len(engine.runner.static_step.graphs)
    for got, expected in zip(outputs["auto"], outputs["off"], strict=True):
        assert got.generated_token_ids == expected.generated_token_ids
        for field in ("log_probs", "sampling_log_probs"):
            torch.testing.assert_close(
                torch.tensor(getattr(got, field)), torch.tensor(getattr(expected, field)), rtol=0, atol=1e-5
            )
    filtered = outputs["off"][2]
    assert filtered.sampling_log_probs != filtered.log_probs  # the filtered row's two log-probs differ


def test_static_decode_keeps_a_scratch_block_outside_the_budget(model_path):
    """The scratch block that padding rows write is not one the block manager hands out, and it fits the budget."""
    model = load_model(model_path, dtype=torch.float32)
    static = ModelRunner(model, block_size=4, static_decode=True)
    eager = ModelRunner(model, block_size=4)
    budget = 10 * eager.block_bytes
    assert eager.blocks_for_bytes(budget) == 10 and static.blocks_for_bytes(budget) == 9
    static.allocate_cache(9)
    assert static.num_blocks == 9 and static._key_cache.shape[1] == 10
    with pytest.raises(ValueError, match="needs static_decode=True"):
        ModelRunner(model, block_size=4, capture_graphs=True)
    with pytest.raises(ValueError, match="decode_graphs='always' is unknown"):
        LLMEngine(model, eos_token_id=None, decode_graphs="always")


def test_graphs_apply_only_to_a_single_device_cuda_model_with_the_triton_decode_kernel(model_path):
    model = load_model(model_path, dtype=torch.float32)
    assert graphs_unsupported(model, block_size=16) is not None  # CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager_decode(model_path, dtype):
    model = load_model(model_path, dtype=dtype, device="cuda", attention_backend="sdpa")
    assert graphs_unsupported(model, block_size=4) is None
    eager, _ = _generate(model, "off")
    graphs, engine = _generate(model, "auto")
    assert engine.stats.cuda_graphs >= 4  # buckets 8, 4, 2, 1 at least
    for got, expected in zip(graphs, eager):
        assert got.generated_token_ids == expected.generated_token_ids
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(
            torch.tensor(got.log_probs), torch.tensor(expected.log_probs), rtol=0, atol=tolerance
        )
    again, _ = _generate(model, "auto")  # a second engine captures again: graphs never outlive their cache
    assert [seq.generated_token_ids for seq in again] == [seq.generated_token_ids for seq in graphs]


def test_kept_block_tables_and_inputs_equal_a_rebuild_at_every_step(model_path, monkeypatch):
    """The static step rewrites a block-table row only when its sequence changes or grows, and sends the tables only
    then: after every fill, each row the step reads still equals the table built afresh (through preemptions, new
    block lists, a shrinking batch and padding rows). Each row's input token, gathered on the device from the host's
    ids or the previous step's samples (a token still pending on the host), is the token the sequence ends up with."""
    model = load_model(model_path, dtype=torch.float32)
    fill, checked, inputs = StaticDecodeStep._fill, [], []

    def checked_fill(step, seqs, rows, **sampling):
        kind = fill(step, seqs, rows, **sampling)
        size = step.block_size
        for row, seq in enumerate(seqs):
            position = len(seq) - 1
            table = seq.block_table
            assert step.block_tables[row, : len(table)].tolist() == table
            assert [step.positions[row].item(), step.context_lens[row].item()] == [position, len(seq)]
            inputs.append((seq, position, step._token_pool[step.token_sources[row]].item()))
            assert step.slot_mapping[row].item() == table[position // size] * size + position % size
        for row in range(len(seqs), rows):
            assert step.block_tables[row, 0].item() == step.scratch_block and step.context_lens[row].item() == 1
            assert step.slot_mapping[row].item() == step.scratch_block * size and step.positions[row].item() == 0
        checked.append(rows)
        return kind

    monkeypatch.setattr(StaticDecodeStep, "_fill", checked_fill)
    _, engine = _generate(model, "static", num_blocks=12, max_num_seqs=3)
    assert engine.num_preemptions > 0 and len(checked) == engine.stats.decode_steps
    assert all(seq.token_ids[position] == token for seq, position, token in inputs)


def test_flash_attn_leaves_graphs_on_by_taking_small_blocks(model_path, monkeypatch):
    """With flash-attn installed the default KV block was 256 (its paged kernel's), where graphs cannot run: with
    graphs possible the engine now takes 16-token blocks (decode through the Triton kernel); without graphs, 256."""
    from spmd_rlhf.engine import llm_engine

    monkeypatch.setattr(llm_engine, "resolve_backend", lambda *args, **kwargs: "flash")
    model = load_model(model_path, dtype=torch.float32)
    assert LLMEngine(model, eos_token_id=None, decode_graphs="off").block_size == 256
    assert LLMEngine(model, eos_token_id=None).block_size == 256  # on CPU graphs are unsupported anyway
    monkeypatch.setattr(llm_engine, "graphs_unsupported", lambda model, block_size: None)  # as on a GPU
    assert LLMEngine(model, eos_token_id=None).block_size == 16
    assert LLMEngine(model, eos_token_id=None, decode_graphs="off").block_size == 256
    assert LLMEngine(model, eos_token_id=None, block_size=512).block_size == 512  # a block size given is kept
