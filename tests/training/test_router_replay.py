"""Router replay in the model and at the boundaries: replaying a router's own choice changes nothing, replaying other
experts routes there with the router's probabilities as weights (so the router still gets gradients), and -1 rows
keep the router's own choice; router replay is refused on a dense model and R2 without a log-prob recompute."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from spmd_rlhf.config import ConfigError, load_config
from spmd_rlhf.models import load_model
from spmd_rlhf.models.moe import TopKRouter
from spmd_rlhf.tiny.model import make_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from host_overhead import one_rank_actor  # noqa: E402


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = make_tiny(family="qwen3_moe", out_dir=str(tmp_path_factory.mktemp("moe")), hidden_size=32, vocab_size=300)
    return load_model(path, dtype=torch.float32)


def routers(model) -> list[TopKRouter]:
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def test_replaying_the_routers_own_choice_changes_nothing(moe_model):
    input_ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    chosen = []
    handles = [
        router.register_forward_hook(lambda m, i, routing: chosen.append(routing)) for router in routers(moe_model)
    ]
    with torch.no_grad():
        expected = moe_model(input_ids)
    for handle in handles:
        handle.remove()
    for router, routing in zip(routers(moe_model), chosen):
        router.replay = routing.experts.to(torch.int8)
    try:
        with torch.no_grad():
            replayed = moe_model(input_ids)
    finally:
        for router in routers(moe_model):
            router.replay = None
    torch.testing.assert_close(replayed, expected, rtol=0, atol=0)


def test_replayed_experts_take_the_routers_probabilities_as_weights_and_pass_gradients():
    router = TopKRouter(8, 4, top_k=2, renormalize=True)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    own = router(x)
    replay = (own.experts + 1) % 4  # other experts for every token ...
    replay[0] = -1  # ... but token 0 keeps its own
    router.replay = replay.to(torch.int8)
    routing = router(x)
    probabilities = own.logits.softmax(-1)
    assert torch.equal(routing.experts[1:], replay[1:]) and torch.equal(routing.experts[0], own.experts[0])
    expected = probabilities.gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, expected / expected.sum(-1, keepdim=True))
    routing.weights[:, 0].sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_router_replay_on_a_dense_model_is_refused(tmp_path):
    dense = make_tiny(family="qwen2", out_dir=str(tmp_path / "dense"), hidden_size=32, vocab_size=300)
    try:
        with pytest.raises(ValueError, match=r"^algorithm.router_replay=rollout replays the experts of a mixture-of"):
            one_rank_actor(dense, rows=4, length=8, micro_batch=4, overrides=("algorithm.router_replay=rollout",))
    finally:
        dist.destroy_process_group()


def test_recompute_replay_needs_the_log_prob_recompute():
    with pytest.raises(ConfigError, match=r"algorithm.router_replay=recompute: records the experts in the old-policy"):
        load_config(None, ["algorithm.router_replay=recompute", "rollout.recompute_log_probs=false"])


def test_rollout_replay_needs_single_turn_generation_in_one_segment():
    with pytest.raises(ConfigError, match=r"algorithm.router_replay=rollout: records the experts of single-turn"):
        load_config(None, ["algorithm.router_replay=rollout", "rollout.environment=tool"])
