"""The engine against references: ``transformers`` greedy generation, full-forward log-probs (unfiltered, and under
the top-k / top-p distribution each token was drawn from), per-request seeds."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine import llm_engine as engine_module
from spmd_rlhf.engine.sampler import filter_logits
from spmd_rlhf.models import load_model, log_probs_from_logits

EOS = 2
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module", params=["qwen2_tied", "llama3"])
def checkpoint(request, tmp_path_factory):
    """(our model, the transformers model) with the same weights."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = write_hf_model(request.param, path)
    return load_model(path, head="lm", dtype=torch.float32), hf_model


def _prompts() -> list[list[int]]:
    """Different lengths; two prompts sharing a 10-token prefix (more than two 4-token blocks); a repeated prompt whose
    length is a whole number of blocks (every block cached for the second copy)."""
    generator = torch.Generator().manual_seed(0)

    def tokens(length: int) -> list[int]:
        return torch.randint(3, 101, (length,), generator=generator).tolist()

    prefix, repeated = tokens(10), tokens(12)
    return [tokens(3), tokens(9), prefix + tokens(4), tokens(15), prefix + tokens(1), repeated, repeated]


def _transformers_greedy(hf_model, prompt: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _response_logits(model, seq) -> torch.Tensor:
    """One full forward over prompt + response: the logits that predict each generated token, [generated, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([seq.token_ids]))
    return logits[0, seq.num_prompt_tokens - 1 : -1]


def _training_log_probs(model, seq, temperature: float) -> torch.Tensor:
    """What the trainer computes for a rollout: the label log-probs of a full forward at the temperature."""
    labels = torch.tensor([seq.generated_token_ids])
    return log_probs_from_logits(_response_logits(model, seq)[None], labels, temperature=temperature)[0]


def test_greedy_matches_transformers_with_and_without_preemption(checkpoint):
    model, hf_model = checkpoint
    prompts = _prompts()
    expected = []
    for prompt in prompts:
        tokens = _transformers_greedy(hf_model, prompt, GREEDY.max_new_tokens, EOS)
        # transformers pads a finished row; the engine's response ends at EOS.
        expected.append(tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens)
    roomy = LLMEngine(model, eos_token_id=EOS, block_size=4)
    tight = LLMEngine(model, eos_token_id=EOS, block_size=4, num_blocks=10, max_num_batched_tokens=24)
    for engine in (roomy, tight):
        outputs = engine.generate(prompts, GREEDY)
        assert [out.generated_token_ids for out in outputs] == expected
        assert all(len(out.log_probs) == len(out.generated_token_ids) for out in outputs)
        assert all(out.sampling_log_probs == out.log_probs for out in outputs)  # greedy: the unfiltered value
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    # The shared prefix (two blocks) and the repeated prompt (three blocks, last token recomputed) are not prefilled
    # twice.
    assert roomy.stats.prefill_tokens == sum(map(len, prompts)) - 8 - 11


def test_eos_stop_tokens_and_length_end_a_response(checkpoint):
    model, hf_model = checkpoint
    free_running = LLMEngine(model, eos_token_id=None).generate(_prompts(), GREEDY)
    assert all(out.finish_reason == "length" and len(out.generated_token_ids) == 12 for out in free_running)
    # A response whose token at some step >= 2 appears there first: making it EOS must stop the response right there.
    prompt, tokens, stop_at = next(
        (out.token_ids[: out.num_prompt_tokens], out.generated_token_ids, i)
        for out in free_running
        for i in range(2, 12)
        if out.generated_token_ids[i] not in out.generated_token_ids[:i]
    )
    expected = tokens[: stop_at + 1]

    by_eos = LLMEngine(model, eos_token_id=tokens[stop_at]).generate([prompt], GREEDY)[0]
    assert by_eos.generated_token_ids == expected and by_eos.finish_reason == "stop"
    assert _transformers_greedy(hf_model, prompt, GREEDY.max_new_tokens, tokens[stop_at]) == expected

    stop_params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(tokens[stop_at], 1000))
    by_stop_id = LLMEngine(model, eos_token_id=None).generate([prompt], stop_params)[0]
    assert by_stop_id.generated_token_ids == expected and by_stop_id.finish_reason == "stop"


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.8)],
    ids=["t1", "t0.7-topk", "t1.3-topp"],
)
def test_sampled_log_probs_equal_training_log_probs(checkpoint, sampling):
    """Both log-probs of every generated token: the unfiltered one equals the trainer's; the sampled one equals the
    full forward's logits filtered and renormalised, and is the unfiltered one bit for bit when nothing filters."""
    model, _ = checkpoint
    params = SamplingParams(max_new_tokens=10, **sampling)
    engine = LLMEngine(model, eos_token_id=EOS, block_size=4, num_blocks=12, seed=3)
    outputs = engine.generate(_prompts(), params)
    assert engine.num_preemptions > 0
    for seq in outputs:
        expected = _training_log_probs(model, seq, params.temperature)
        torch.testing.assert_close(torch.tensor(seq.log_probs), expected, atol=1e-6, rtol=0)
        scaled = _response_logits(model, seq) / params.temperature
        filtered = filter_logits(scaled, top_k=params.top_k, top_p=params.top_p).log_softmax(-1)
        under_filter = filtered.gather(1, torch.tensor(seq.generated_token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(seq.sampling_log_probs), under_filter, atol=1e-6, rtol=0)
    equal = [seq.sampling_log_probs == seq.log_probs for seq in outputs]
    assert all(equal) if params.top_k == 0 and params.top_p == 1 else not any(equal)


def test_a_seeded_request_samples_the_same_tokens_alone_in_a_batch_and_under_preemption(checkpoint):
    model, _ = checkpoint
    prompts = _prompts()
    seeded = SamplingParams(temperature=1.0, max_new_tokens=12, seed=123)
    others = [
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=None if i % 2 else i) for i in range(len(prompts) - 1)
    ]
    alone = LLMEngine(model, eos_token_id=None, block_size=4).generate([prompts[3]], seeded)[0].generated_token_ids

    batch = prompts[:3] + prompts[4:] + [prompts[3]]
    in_batch = LLMEngine(model, eos_token_id=None, block_size=4, seed=5).generate(batch, others + [seeded])[-1]
    tight = LLMEngine(model, eos_token_id=None, block_size=4, num_blocks=12, seed=6)
    under_preemption = tight.generate(batch, others + [seeded])[-1]
    assert tight.num_preemptions > 0
    assert in_batch.generated_token_ids == alone and under_preemption.generated_token_ids == alone
    another_seed = SamplingParams(temperature=1.0, max_new_tokens=12, seed=124)
    assert LLMEngine(model, eos_token_id=None).generate([prompts[3]], another_seed)[0].generated_token_ids != alone


def test_samples_of_one_prompt_share_its_prompt_blocks(checkpoint):
    model, _ = checkpoint
    prompt = _prompts()[3][:13]  # three full 4-token blocks and one partial
    engine = LLMEngine(model, eos_token_id=None, block_size=4)
    samples = engine.generate([prompt] * 4, [SamplingParams(max_new_tokens=3, seed=seed) for seed in range(4)])
    # One copy of the three full blocks plus each sample's own partial block (16 without sharing); the three copies
    # after the first prefill only their last prompt token.
    assert engine.stats.max_blocks_in_use == 3 + 4
    assert engine.stats.prefill_tokens == 13 + 3 * 1
    assert len({tuple(seq.generated_token_ids) for seq in samples}) > 1


def test_prompts_longer_than_the_step_budget_are_prefilled_in_chunks(checkpoint, monkeypatch):
    """Chunked prefill: with a token budget of 6 per step, the 15-token prompt (and every prompt that does not fit what
    a step has left) is prefilled over several steps, no step computes more than 6 tokens, and the tokens and
    log-probs equal a roomy engine's (prompts sharing prefixes and a repeated prompt included, and under
    preemption), with the shared prefixes still not prefilled twice."""
    model, _ = checkpoint
    prompts = _prompts()
    params = [SamplingParams(temperature=0, max_new_tokens=6)] + [
        SamplingParams(temperature=1.0, top_k=30, max_new_tokens=5, seed=seed) for seed in range(1, len(prompts))
    ]
    roomy = LLMEngine(model, eos_token_id=None, block_size=4)
    expected = roomy.generate(prompts, params)
    step_tokens = []
    run = roomy.runner.__class__.run

    def counting_run(runner, seqs, *, is_prefill):
        if is_prefill:
            step_tokens.append(sum(seq.prefill_end - seq.num_cached_tokens for seq in seqs))
        return run(runner, seqs, is_prefill=is_prefill)

    monkeypatch.setattr(roomy.runner.__class__, "run", counting_run)
    for engine_args in ({}, {"num_blocks": 12}):
        step_tokens.clear()
        chunked = LLMEngine(model, eos_token_id=None, block_size=4, max_num_batched_tokens=6, **engine_args)
        outputs = chunked.generate(prompts, params)
        for got, want in zip(outputs, expected):
            assert got.generated_token_ids == want.generated_token_ids
            torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs), rtol=0, atol=1e-5)
        assert max(step_tokens) <= 6 and len(step_tokens) == chunked.stats.prefill_steps
        assert sum(step_tokens) == chunked.stats.prefill_tokens
        assert all(seq.prefill_end is None for seq in outputs)
        if not engine_args:
            assert chunked.stats.prefill_tokens == roomy.stats.prefill_tokens == sum(map(len, prompts)) - 8 - 11
    assert chunked.num_preemptions > 0


def test_an_8k_token_prompt_prefilled_in_chunks_gives_the_training_log_probs(checkpoint):
    """Long reasoning rows: a prompt of 8,200 tokens prefilled in chunks of at most 2,048 tokens (five steps), then
    sampled responses, whose log-probs equal a training forward over the whole row within 1e-5 (float32)."""
    model, _ = checkpoint
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 101, (8200,), generator=generator).tolist()
    engine = LLMEngine(model, eos_token_id=None, block_size=16, max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed) for seed in range(2)]
    outputs = engine.generate([prompt, prompt], params)
    assert engine.stats.prefill_steps == 5 and engine.stats.prefill_tokens == 8200 + 8  # the copy shares 512 blocks
    for seq in outputs:
        torch.testing.assert_close(
            torch.tensor(seq.log_probs), _training_log_probs(model, seq, temperature=1.0), rtol=0, atol=1e-5
        )


def test_cache_is_allocated_on_demand_and_can_be_freed(checkpoint):
    model, _ = checkpoint
    prompts = _prompts()[:3]
    args = model.args
    block_bytes = 4 * 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4  # 4 tokens, K and V, float32
    engine = LLMEngine(model, eos_token_id=EOS, block_size=4, kv_cache_bytes=20 * block_bytes + block_bytes // 2)
    assert engine.runner.num_blocks == 0
    first = [out.generated_token_ids for out in engine.generate(prompts, GREEDY)]
    assert engine.runner.num_blocks == 20
    engine.free_cache()
    assert engine.runner.num_blocks == 0
    assert [out.generated_token_ids for out in engine.generate(prompts, GREEDY)] == first
    assert engine.stats.generated_tokens == sum(map(len, first)) and engine.stats.decode_steps > 0


def test_a_memory_sized_cache_is_no_larger_than_max_num_seqs_rows_at_max_model_len(checkpoint):
    model, _ = checkpoint
    huge = 1 << 40  # what a mostly empty GPU's memory_fraction would offer
    engine = LLMEngine(model, eos_token_id=EOS, block_size=4, max_num_seqs=3, max_model_len=10, kv_cache_bytes=huge)
    assert engine.fixed_num_blocks == 3 * 3  # 3 rows of ceil(10 / 4) blocks
    assert LLMEngine(model, eos_token_id=EOS, block_size=4, kv_cache_bytes=huge).fixed_num_blocks > 10**6
    assert LLMEngine(model, eos_token_id=EOS, block_size=4, max_model_len=10, num_blocks=50).fixed_num_blocks == 50


def test_bad_requests_are_refused_with_the_fix_named(checkpoint):
    model, _ = checkpoint
    engine = LLMEngine(model, eos_token_id=EOS, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine.generate([[5], [6], [7]], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match=r"prompt 1 has token ids outside the model's vocabulary \[0, 101\)"):
        engine.generate([[5], [5, 101]], GREEDY)
    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        engine.generate([list(range(3, 12))], GREEDY)
    with pytest.raises(ValueError, match="num_blocks or as kv_cache_bytes, not both"):
        LLMEngine(model, eos_token_id=EOS, num_blocks=4, kv_cache_bytes=1 << 20)
    assert engine.generate([], GREEDY) == []


def test_unseeded_requests_follow_the_engine_seed_and_request_number(checkpoint):
    model, _ = checkpoint
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)

    def responses(engine):
        return [seq.generated_token_ids for seq in engine.generate(prompts, params)]

    first_engine, same_seed = LLMEngine(model, eos_token_id=None, seed=5), LLMEngine(model, eos_token_id=None, seed=5)
    first = responses(first_engine)
    assert responses(same_seed) == first
    # The request count runs on across calls: repeating a call draws new responses.
    assert responses(first_engine) != first
    assert responses(LLMEngine(model, eos_token_id=None, seed=6)) != first


def test_block_size_defaults_from_the_attention_backend(checkpoint, monkeypatch):
    """Unset, the block size is 16, or 256 where flash-attn reads the cache (its paged kernel's smallest block)."""
    model, _ = checkpoint
    assert LLMEngine(model, eos_token_id=EOS).block_size == 16  # SDPA on CPU
    assert LLMEngine(model, eos_token_id=EOS, block_size=8).block_size == 8
    monkeypatch.setattr(engine_module, "resolve_backend", lambda backend, *, device, dtype: "flash")
    assert LLMEngine(model, eos_token_id=EOS).runner.block_size == 256
