"""The routers' load-balancing loss and z-loss: the load-balancing loss of one layer equals transformers'
``load_balancing_loss_func`` with padding masked; in the real ``ActorWorker.update_actor`` (one CPU rank, a tiny
Qwen3-MoE) a coefficient > 0 changes the router weights' gradient, 0 leaves it as without the losses, the metrics
come back, and an update reads as many scalars at 8 micro-batches as at 2 (no host sync per micro-batch); a nonzero
coefficient on a dense model is refused at build time, naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from spmd_rlhf.models.moe import Routing
from spmd_rlhf.tiny.model import make_tiny
from spmd_rlhf.training.router_losses import load_balancing_loss, z_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_update import synthetic_rollout  # noqa: E402
from host_overhead import count_update, one_rank_actor  # noqa: E402

ROWS, LENGTH = 8, 12
ROUTER = "model.layers.0.mlp.gate.weight"


def routing_of(logits: torch.Tensor, top_k: int) -> Routing:
    weights, experts = logits.softmax(-1).topk(top_k, dim=-1)
    return Routing(logits, experts, weights)


def test_load_balancing_loss_equals_transformers_with_padding_masked():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3 * 5, 8, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = load_balancing_loss_func((logits,), num_experts=8, top_k=2, attention_mask=mask)
    ours = load_balancing_loss(routing_of(logits, 2), 8, mask.flatten())
    torch.testing.assert_close(ours, expected)
    # Padding counts for nothing: the real tokens alone give the same loss.
    torch.testing.assert_close(load_balancing_loss(routing_of(logits[mask.flatten().bool()], 2), 8), expected)


def test_z_loss_is_the_mean_squared_logsumexp_of_real_tokens():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([1, 1, 0, 1, 0, 1])
    expected = logits[mask.bool()].logsumexp(-1).square().mean()
    torch.testing.assert_close(z_loss(routing_of(logits, 2), mask), expected)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny(family="qwen3_moe", out_dir=str(tmp_path_factory.mktemp("moe")), hidden_size=32, vocab_size=300)


def router_gradient_and_metrics(model_dir: str, *overrides: str, losses_off: bool = False, zero_routers: bool = False):
    """The router weight's gradient in the optimizer step of one ``update_actor``, and its metrics. ``zero_routers``:
    every router's weights zeroed first, so every token's logits tie and all take the same ``top_k`` experts."""
    actor = one_rank_actor(model_dir, rows=ROWS, length=LENGTH, micro_batch=ROWS // 2, overrides=overrides)
    if losses_off:
        actor.trainer.router_losses = None
    if zero_routers:
        with torch.no_grad():
            for name, param in actor.model.module.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.zero_()
    router = dict(actor.model.module.named_parameters())[ROUTER]
    seen = []
    actor.trainer.optimizer.register_step_pre_hook(lambda *_: seen.append(router.grad.detach().clone()))
    gates = [module for name, module in actor.model.module.named_modules() if name.endswith("mlp.gate")]
    routed: list[torch.Tensor] = []  # each training forward's chosen experts, layer after layer
    for gate in gates:
        gate.register_forward_hook(
            lambda module, inputs, routing: routed.append(routing.experts.detach()) if module.training else None
        )
    batch = synthetic_rollout(ROWS, LENGTH, actor.model.module.args.vocab_size, seed=0)
    metrics = actor.update_actor(batch)
    metrics["routed"] = [routed[start : start + len(gates)] for start in range(0, len(routed), len(gates))]
    return seen[0], metrics


def expected_load(forwards: list[list[torch.Tensor]], num_experts: int) -> float:
    """The expert-load metric recomputed from the chosen experts: per forward the worst layer's most choices of any
    expert over the mean per expert, averaged over the update's micro-batches."""
    worst = []
    for layers in forwards:
        counts = [torch.bincount(experts.flatten(), minlength=num_experts).float() for experts in layers]
        worst.append(max(float(count.max() / count.mean()) for count in counts))
    return sum(worst) / len(worst)


def test_router_loss_coefficients_change_the_router_gradient(moe_dir):
    try:
        plain, _ = router_gradient_and_metrics(moe_dir, losses_off=True)
        zero, metrics = router_gradient_and_metrics(
            moe_dir, "actor.router_aux_loss_coef=0", "actor.router_z_loss_coef=0"
        )
        aux, _ = router_gradient_and_metrics(moe_dir, "actor.router_aux_loss_coef=0.5")
        z, _ = router_gradient_and_metrics(moe_dir, "actor.router_aux_loss_coef=0", "actor.router_z_loss_coef=0.5")
        _, tied = router_gradient_and_metrics(moe_dir, zero_routers=True)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(zero, plain, rtol=0, atol=0)
    assert (aux - plain).abs().max() > 1e-4 and (z - plain).abs().max() > 1e-4
    top_k = 2  # make_tiny's num_experts_per_tok: uniform routing gives k, and the loss is at least about that
    assert metrics["actor/router_aux_loss"] >= top_k * 0.99 and metrics["actor/router_z_loss"] > 0
    # Tied routers send every token to the same top_k of the 4 experts: max / mean = T / (k T / 4) = 4 / k exactly;
    # the random routers spread the tokens, below that.
    assert tied["actor/expert_load_max_over_mean"] == pytest.approx(4 / top_k)
    # The random routers' value is the one their recorded choices give (two micro-batches, every MoE layer).
    assert len(metrics["routed"]) == 2
    load = metrics["actor/expert_load_max_over_mean"]
    assert load == pytest.approx(expected_load(metrics["routed"], 4), rel=1e-6) and load < 4 / top_k
    for layer in range(2):  # each MoE layer's own, averaged over the micro-batches
        own = expected_load([[forward[layer]] for forward in metrics["routed"]], 4)
        assert metrics[f"actor/expert_load_max_over_mean/layer_{layer}"] == pytest.approx(own, rel=1e-6), layer


def test_a_router_loss_on_a_dense_model_is_refused(tmp_path):
    dense = make_tiny(family="qwen2", out_dir=str(tmp_path / "dense"), hidden_size=32, vocab_size=300)
    try:
        with pytest.raises(ValueError, match=r"^actor.router_z_loss_coef=0.1 needs a mixture-of-experts model"):
            one_rank_actor(
                dense, rows=ROWS, length=LENGTH, micro_batch=ROWS, overrides=("actor.router_z_loss_coef=0.1",)
            )
    finally:
        dist.destroy_process_group()


def test_router_losses_and_metrics_read_nothing_back_per_micro_batch(moe_dir):
    try:
        counts = {
            micro_batches: count_update(
                moe_dir,
                rows=ROWS,
                length=LENGTH,
                micro_batch=ROWS // micro_batches,
                overrides=("actor.router_aux_loss_coef=0.1", "actor.router_z_loss_coef=0.1"),
            )
            for micro_batches in (2, 8)
        }
    finally:
        dist.destroy_process_group()
    few, many = counts[2], counts[8]
    assert few.scalar_reads == many.scalar_reads, (dict(few.scalar_read_sites), dict(many.scalar_read_sites))
