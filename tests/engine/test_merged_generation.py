"""The engine on a generation copy with merged q/k/v and gate/up projections (``merge_projections``, as the reshard
and the rollout role build it) generates the tokens and log-probs of the unmerged model: greedy and seeded sampling,
eager steps and the graphs' fixed-address padded steps."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_fixtures import write_hf_model

from spmd_rlhf.engine import LLMEngine, SamplingParams
from spmd_rlhf.models import load_model, log_probs_from_logits
from spmd_rlhf.models.merged_linear import merge_projections

EOS = 2
PROMPTS = [[5, 9, 17, 3, 44], [8, 8, 21], [60, 7, 7, 30, 12, 91, 4, 15, 33]]


@pytest.fixture(scope="module", params=["qwen2_tied", "qwen2_moe"])
def models(request, tmp_path_factory):
    """(unmerged, merged) float32 generation copies of one checkpoint: q/k/v biases (qwen2); MoE layers with a
    shared expert (qwen2_moe)."""
    path = str(tmp_path_factory.mktemp(request.param))
    write_hf_model(request.param, path)
    model = load_model(path, head="lm", dtype=torch.float32).requires_grad_(False).eval()
    merged = copy.deepcopy(model)
    assert merge_projections(merged) > 0
    return model, merged


@pytest.mark.parametrize("decode_graphs", ["off", "static"])
@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "sampled"])
def test_merged_projections_generate_the_unmerged_tokens_and_log_probs(models, decode_graphs, params):
    model, merged = models
    sampling = SamplingParams(max_new_tokens=10, **params)
    outputs = {
        name: LLMEngine(candidate, eos_token_id=EOS, block_size=4, decode_graphs=decode_graphs).generate(
            PROMPTS, sampling
        )
        for name, candidate in (("unmerged", model), ("merged", merged))
    }
    for reference, seq in zip(outputs["unmerged"], outputs["merged"]):
        assert seq.generated_token_ids == reference.generated_token_ids
        torch.testing.assert_close(torch.tensor(seq.log_probs), torch.tensor(reference.log_probs), atol=1e-6, rtol=0)
        # What the trainer computes on the unmerged (training) model's full forward.
        with torch.no_grad():
            logits = model(torch.tensor([seq.token_ids]))[:, seq.num_prompt_tokens - 1 : -1]
        labels = torch.tensor([seq.generated_token_ids])
        training = log_probs_from_logits(logits, labels, temperature=sampling.temperature or 1.0)[0]
        torch.testing.assert_close(torch.tensor(seq.log_probs), training, atol=1e-6, rtol=0)
