"""The engine with a mixture-of-experts model (a tiny Qwen3-MoE, float32): greedy tokens equal ``transformers``' greedy
``generate`` on both expert paths, with and without preemption; sampled log-probs equal a full forward's; CUDA graphs
are refused, with the reason, where the expert loop (a host sync per layer) would run; with ``record_routes`` every
processed token's experts are recorded, equal to a full forward's (router replay's record)."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import write_hf_model
from test_engine import EOS, GREEDY, _prompts, _training_log_probs, _transformers_greedy

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.engine.decode_graphs import graphs_unsupported
from spmd_rlhf.engine.routes import rollout_routes
from spmd_rlhf.models import load_model
from spmd_rlhf.models.moe import TopKRouter


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    hf_model = write_hf_model("qwen3_moe", path)
    return load_model(path, head="lm", dtype=torch.float32), hf_model


def use_grouped_mm(model: torch.nn.Module, grouped: bool | None) -> None:
    for module in model.modules():
        if hasattr(module, "grouped_mm"):
            module.grouped_mm = grouped


@pytest.mark.parametrize("grouped", [True, False])
def test_greedy_matches_transformers_with_and_without_preemption(checkpoint, grouped):
    model, hf_model = checkpoint
    use_grouped_mm(model, grouped)
    prompts = _prompts()
    expected = []
    for prompt in prompts:
        tokens = _transformers_greedy(hf_model, prompt, GREEDY.max_new_tokens, EOS)
        expected.append(tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens)
    roomy = LLMEngine(model, eos_token_id=EOS, block_size=4)
    tight = LLMEngine(model, eos_token_id=EOS, block_size=4, num_blocks=10, max_num_batched_tokens=24)
    try:
        for engine in (roomy, tight):
            assert [out.generated_token_ids for out in engine.generate(prompts, GREEDY)] == expected
    finally:
        use_grouped_mm(model, None)
    assert tight.num_preemptions > 0


def test_sampled_log_probs_equal_training_log_probs(checkpoint):
    model, _ = checkpoint
    params = SamplingParams(temperature=0.8, max_new_tokens=10, seed=3)
    for out in LLMEngine(model, eos_token_id=None, block_size=4).generate(_prompts(), params):
        expected = _training_log_probs(model, out, 0.8)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, rtol=0, atol=1e-5)


def test_cuda_graphs_are_refused_where_the_expert_loop_would_run(checkpoint):
    model, _ = checkpoint
    use_grouped_mm(model, False)
    try:
        reason = graphs_unsupported(model, block_size=16)
    finally:
        use_grouped_mm(model, None)
    assert reason.startswith("the MoE experts run as a loop over experts"), reason
    assert "MoE" not in graphs_unsupported(model, block_size=16)  # grouped GEMMs: only the CPU stops the graphs


def full_forward_routes(model, token_ids: list[int]) -> torch.Tensor:
    """The experts a full forward over ``token_ids`` routes each token to: ``[tokens, moe_layers, k]``."""
    seen = []
    handles = [
        module.register_forward_hook(lambda m, i, routing: seen.append(routing.experts))
        for module in model.modules()
        if isinstance(module, TopKRouter)
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(seen, dim=1)


@pytest.mark.parametrize("tight", [False, True])
def test_recorded_routes_equal_a_full_forwards(checkpoint, tight):
    """Every processed token's experts (shared prompt blocks of n samples, and re-prefills after preemption, included),
    in the rollout layout too."""
    model, _ = checkpoint
    prompts = _prompts()[:4] * 2  # each prompt twice: the second copy reads its prompt's blocks from the cache
    sizing = {"num_blocks": 12, "max_num_batched_tokens": 24} if tight else {}
    engine = LLMEngine(model, eos_token_id=None, block_size=4, record_routes=True, **sizing)
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed) for seed in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    assert (engine.num_preemptions > 0) == tight and engine.stats.cached_prefill_tokens > 0
    for out in outputs:
        recorded = torch.cat(out.routed_experts)
        assert recorded.dtype == torch.int8 and len(recorded) == len(out.token_ids) - 1
        assert torch.equal(recorded.long(), full_forward_routes(model, out.token_ids[:-1]))
    width = max(len(prompt) for prompt in prompts)
    laid_out = rollout_routes(outputs, prompt_width=width, response_width=10)
    first = outputs[0]
    pad = width - first.num_prompt_tokens
    assert (laid_out[0, :pad] == -1).all() and (laid_out[0, -1] == -1).all()  # padding; the last token unprocessed
    assert torch.equal(laid_out[0, pad : width + 9], torch.cat(first.routed_experts))


def test_recording_routes_needs_an_moe_model(tmp_path):
    write_hf_model("qwen2_tied", str(tmp_path))
    dense = load_model(str(tmp_path), dtype=torch.float32)
    with pytest.raises(ValueError, match="router replay records the experts of a mixture-of-experts model"):
        LLMEngine(dense, eos_token_id=None, record_routes=True)
