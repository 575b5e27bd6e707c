"""The overlapped decode loop (tokens read back one step late, ``LLMEngine(overlap_host=True)``) against the
synchronous one: the same tokens, log-probs and finish reasons for greedy and seeded rows that end at different steps
(length limits, EOS, stop tokens), through preemption, segments and the stand-in for CUDA graph replay; the tokens of
rows that ended while the next step was in flight are dropped; and no step in steady state reads a tensor on the
host."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine.decode_graphs import StaticDecodeStep
from spmd_rlhf.models import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [70, 71, 72], [3, 4], [90] * 17]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    write_hf_model("qwen2_untied", path)
    return load_model(path, dtype=torch.float32)


def _params(stops: list[frozenset[int]] | None = None) -> list[SamplingParams]:
    """Greedy and seeded rows of different lengths; an unseeded row takes the engine's seed."""
    stops = stops or [frozenset()] * 5
    return [
        SamplingParams(temperature=0, max_new_tokens=4, stop_token_ids=stops[0]),
        SamplingParams(temperature=1.0, top_k=20, max_new_tokens=13, seed=1, stop_token_ids=stops[1]),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=7, seed=2, stop_token_ids=stops[2]),
        SamplingParams(temperature=0, max_new_tokens=11, stop_token_ids=stops[3]),
        SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=stops[4]),
    ]


def _engine(model, *, overlap: bool, eos: int | None = None, **engine_args) -> LLMEngine:
    args = {"block_size": 4, "decode_graphs": "static", "seed": 3} | engine_args
    return LLMEngine(model, eos_token_id=eos, overlap_host=overlap, **args)


def _stops(model) -> tuple[int, list[frozenset[int]]]:
    """An EOS and stop tokens that end rows mid-response: tokens the rows generate without them, at different
    positions (so rows end at different steps)."""
    free = _engine(model, overlap=False).generate(PROMPTS, _params())
    eos = free[3].generated_token_ids[5]
    stops = [frozenset()] * 5
    stops[1] = frozenset({free[1].generated_token_ids[8]})
    stops[4] = frozenset({free[4].generated_token_ids[2], free[4].generated_token_ids[9]})
    return eos, stops


def _assert_same(got, expected) -> None:
    for overlapped, synchronous in zip(got, expected, strict=True):
        assert overlapped.generated_token_ids == synchronous.generated_token_ids
        assert overlapped.finish_reason == synchronous.finish_reason
        assert not overlapped.token_pending and -1 not in overlapped.token_ids
        for field in ("log_probs", "sampling_log_probs"):
            torch.testing.assert_close(
                torch.tensor(getattr(overlapped, field)), torch.tensor(getattr(synchronous, field)), rtol=0, atol=1e-6
            )


@pytest.fixture(params=["static", "graphs"])
def decode_mode(request):
    """``static``: the graphs' inputs run eagerly; ``graphs``: captured and replayed through the stand-in, the path
    of ``decode_graphs="auto"`` on CUDA (the token gather replays inside the graph)."""
    if request.param == "graphs":
        request.getfixturevalue("replayed_graphs")
        return "auto"
    return "static"


@pytest.mark.parametrize("engine_args", [{}, {"num_blocks": 13, "max_num_seqs": 3}], ids=["roomy", "preempting"])
def test_overlapped_loop_equals_the_synchronous_loop(model, decode_mode, engine_args, monkeypatch):
    eos, stops = _stops(model)
    expected = _engine(model, overlap=False, eos=eos, **engine_args).generate(PROMPTS, _params(stops))
    assert {seq.finish_reason for seq in expected} == {"stop", "length"}
    assert len({seq.num_generated for seq in expected}) >= 4  # rows end at different steps

    steps_of = {}
    run = StaticDecodeStep.run

    def counted_run(step, seqs, **sampling):
        for seq in seqs:
            steps_of[seq.seq_id] = steps_of.get(seq.seq_id, 0) + 1
        return run(step, seqs, **sampling)

    monkeypatch.setattr(StaticDecodeStep, "run", counted_run)
    engine = _engine(model, overlap=True, eos=eos, **engine_args)
    got = engine.generate(PROMPTS, _params(stops))
    _assert_same(got, expected)
    assert engine.stats.generated_tokens == sum(seq.num_generated for seq in expected)
    if engine_args:
        assert engine.num_preemptions > 0
    else:
        # A row decodes every token but its first (the prefill's); one that stopped on a token ran one more step,
        # launched before that token was read, whose token was dropped. Rows ending by length take no extra step.
        extra = {seq.seq_id: steps_of[seq.seq_id] - (seq.num_generated - 1) for seq in expected}
        assert {extra[seq.seq_id] for seq in expected if seq.finish_reason == "length"} == {0}
        assert {extra[seq.seq_id] for seq in expected if seq.finish_reason == "stop"} == {1}


def test_segments_end_where_the_synchronous_loop_ends_them(model):
    """Each segment stops where the synchronous loop's does: a step launched past the segment's end is dropped."""
    eos, stops = _stops(model)
    runs = {}
    for overlap in (False, True):
        engine = _engine(model, overlap=overlap, eos=eos)
        run = engine.start(PROMPTS, _params(stops))
        counts = []
        while not engine.advance(run, segment_tokens=2):
            counts.append([seq.num_generated for seq in run.seqs])
            assert not any(seq.token_pending for seq in run.seqs)
        runs[overlap] = (counts, run.seqs)
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) >= 3
    _assert_same(runs[True][1], runs[False][1])


def test_steady_decode_reads_nothing_on_the_host(model, monkeypatch):
    """Only prefill steps read their samples with ``tolist`` (a device sync on a GPU); overlapped decode steps read
    theirs from the host buffer one step late."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda tensor: reads.append(1) or tolist(tensor))
    for overlap in (True, False):
        reads.clear()
        engine = _engine(model, overlap=overlap)
        engine.generate(PROMPTS, _params())
        stats = engine.stats
        assert len(reads) == stats.prefill_steps + (0 if overlap else stats.decode_steps)


def test_eager_decode_steps_stay_synchronous(model):
    """Without the static step (``decode_graphs="off"``) no token is ever pending: the switch changes nothing."""
    eos, stops = _stops(model)
    expected = _engine(model, overlap=False, eos=eos, decode_graphs="off").generate(PROMPTS, _params(stops))
    _assert_same(_engine(model, overlap=True, eos=eos, decode_graphs="off").generate(PROMPTS, _params(stops)), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlapped_cuda_graph_loop_equals_the_synchronous_loop(model):
    cuda = model.to("cuda")
    cuda.attention_backend = "sdpa"
    eos, stops = _stops(cuda)
    expected = _engine(cuda, overlap=False, eos=eos, decode_graphs="auto").generate(PROMPTS, _params(stops))
    engine = _engine(cuda, overlap=True, eos=eos, decode_graphs="auto")
    _assert_same(engine.generate(PROMPTS, _params(stops)), expected)
    assert engine.stats.cuda_graphs > 0
