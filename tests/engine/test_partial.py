"""Partial rollouts on the engine: a generation advanced in segments, with weight updates between them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.models import load_model, log_probs_from_logits

EOS = 2
SEGMENT = 3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Two checkpoints of one shape with different weights: policy versions 0 and 1."""
    paths = []
    for seed in range(2):
        path = str(tmp_path_factory.mktemp(f"llama3_seed{seed}"))
        write_hf_model("llama3", path, seed=seed)
        paths.append(path)
    return paths


def _model(path: str):
    return load_model(path, head="lm", dtype=torch.float32)


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """Seeded samples of prompts of different lengths, two samples per prompt (shared prompt blocks)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 101, (length,), generator=generator).tolist() for length in (3, 9, 6, 13)]
    requests = [prompt for prompt in prompts for _ in range(2)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed) for seed in range(len(requests))]
    return requests, params


def _training_log_probs(model, token_ids: list[int], num_prompt_tokens: int) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = model(ids)
    return log_probs_from_logits(logits[:, :-1], ids[:, 1:], temperature=1.0)[0, num_prompt_tokens - 1 :]


def _swap(model, path: str) -> None:
    with torch.no_grad():
        model.load_state_dict(_model(path).state_dict())


@pytest.mark.parametrize("num_blocks", [None, 14], ids=["roomy", "preempting"])
def test_segments_with_kv_kept_on_the_same_weights_equal_one_uninterrupted_generation(paths, num_blocks):
    requests, params = _requests()
    whole = LLMEngine(_model(paths[0]), eos_token_id=EOS, block_size=4, num_blocks=num_blocks).generate(
        requests, params
    )
    engine = LLMEngine(_model(paths[0]), eos_token_id=EOS, block_size=4, num_blocks=num_blocks)
    run = engine.start(requests, params, version=0)
    versions = 0
    while not engine.advance(run, segment_tokens=SEGMENT):
        versions += 1
        run.update_weights(versions, "keep_kv")  # the same weights under a new version number
    assert versions >= 2
    assert (engine.stats.preemptions > 0) == (num_blocks is not None)
    for seq, reference in zip(run.seqs, whole):
        assert seq.generated_token_ids == reference.generated_token_ids
        assert seq.log_probs == reference.log_probs  # bit for bit: the same engine steps
        tagged = run.token_versions(seq)
        assert len(tagged) == seq.num_generated and tagged == sorted(tagged)
    # Without preemption every unfinished request moves in lockstep: exactly SEGMENT tokens per version.
    if num_blocks is None:
        longest = max(run.seqs, key=lambda seq: seq.num_generated)
        assert run.token_versions(longest)[: 2 * SEGMENT + 1] == [0] * SEGMENT + [1] * SEGMENT + [2]


@pytest.mark.parametrize("in_flight", ["keep_kv", "recompute_kv"])
def test_tokens_after_a_weight_update_are_tagged_and_sampled_by_the_new_weights(paths, in_flight):
    requests, params = _requests()
    old, new = _model(paths[0]), _model(paths[1])
    engine = LLMEngine(_model(paths[0]), eos_token_id=EOS, block_size=4)
    run = engine.start(requests, params, version=0)
    assert not engine.advance(run, segment_tokens=SEGMENT)
    in_flight_ids = {seq.seq_id for seq in run.unfinished}
    _swap(engine.runner.model, paths[1])
    run.update_weights(1, in_flight)
    prefilled = engine.stats.prefill_tokens
    assert engine.advance(run)
    # recompute_kv prefills each request in flight again (prompt and tokens so far); keep_kv prefills nothing.
    assert (engine.stats.prefill_tokens > prefilled) == (in_flight == "recompute_kv")
    mixed = 0
    for seq in run.seqs:
        versions = torch.tensor(run.token_versions(seq))
        if seq.seq_id not in in_flight_ids:
            assert versions.tolist() == [0] * seq.num_generated
            continue
        assert versions[:SEGMENT].tolist() == [0] * SEGMENT and (versions[SEGMENT:] == 1).all()
        mixed += seq.num_generated > SEGMENT
        log_probs = torch.tensor(seq.log_probs)
        before = _training_log_probs(old, seq.token_ids, seq.num_prompt_tokens)
        after = _training_log_probs(new, seq.token_ids, seq.num_prompt_tokens)
        torch.testing.assert_close(log_probs[:SEGMENT], before[:SEGMENT], atol=1e-6, rtol=0)
        if in_flight == "recompute_kv":  # the new policy's own log-probs, on every token it sampled
            torch.testing.assert_close(log_probs[SEGMENT:], after[SEGMENT:], atol=1e-6, rtol=0)
        else:  # the first token after the update is the new weights' on the old K/V of the prompt and tokens before
            assert not torch.allclose(log_probs[SEGMENT:], after[SEGMENT:], atol=1e-6, rtol=0)
    assert mixed >= 2


def test_dropped_requests_restart_from_the_prompt_under_the_new_weights(paths):
    requests, params = _requests()
    fresh = LLMEngine(_model(paths[1]), eos_token_id=EOS, block_size=4).generate(requests, params)
    engine = LLMEngine(_model(paths[0]), eos_token_id=EOS, block_size=4)
    run = engine.start(requests, params, version=0)
    engine.advance(run, segment_tokens=SEGMENT)
    finished_early = {seq.seq_id: list(seq.generated_token_ids) for seq in run.seqs if seq.is_finished}
    _swap(engine.runner.model, paths[1])
    run.update_weights(1, "drop")
    engine.advance(run)
    assert len(finished_early) < len(requests)
    for seq, reference in zip(run.seqs, fresh):
        versions = run.token_versions(seq)
        if seq.seq_id in finished_early:
            assert seq.generated_token_ids == finished_early[seq.seq_id] and versions == [0] * seq.num_generated
        else:  # what the new weights generate from the prompt with the request's seed, one version throughout
            assert seq.generated_token_ids == reference.generated_token_ids and versions == [1] * seq.num_generated
            torch.testing.assert_close(seq.log_probs, reference.log_probs, atol=1e-6, rtol=0)
            assert seq.sampling_log_probs == seq.log_probs  # cleared with the tokens at the restart


@pytest.mark.parametrize("in_flight", ["keep_kv", "recompute_kv", "drop"])
def test_a_run_snapshotted_between_segments_and_restored_goes_on_exactly(paths, in_flight, tmp_path):
    """A checkpoint in flight: snapshot (through JSON) and K/V blocks taken after a segment, restored into a fresh
    engine; both then take the new weights and finish. Everything equals, bit for bit, both log-probs included
    (top-p makes them differ)."""
    import json

    requests, params = _requests()
    params = [replace(row_params, top_p=0.9) for row_params in params]
    results = []
    for restored in (False, True):
        engine = LLMEngine(_model(paths[0]), eos_token_id=EOS, block_size=4, num_blocks=14)
        run = engine.start(requests, params, version=0)
        engine.advance(run, segment_tokens=SEGMENT)
        engine.advance(run, segment_tokens=SEGMENT)
        if restored:
            snapshot, blocks = json.loads(json.dumps(run.snapshot())), run.kv_blocks
            cache = {key: tensor.clone() for key, tensor in engine.runner.read_blocks(blocks).items()}
            engine = LLMEngine(_model(paths[0]), eos_token_id=EOS, block_size=4)  # sized to the saved run's cache
            run = engine.resume(requests, params, snapshot, cache)
            assert run.kv_blocks == blocks
        _swap(engine.runner.model, paths[1])
        run.update_weights(1, in_flight)
        engine.advance(run)
        results.append(
            [(seq.token_ids, seq.log_probs, seq.sampling_log_probs, run.token_versions(seq)) for seq in run.seqs]
        )
        results[-1].append(run.num_preemptions)
    assert results[1] == results[0]
    assert all(log_probs != sampling_log_probs for _, log_probs, sampling_log_probs, _ in results[0][:-1])
    assert results[0][-1] > 0  # a cache tight enough to preempt
