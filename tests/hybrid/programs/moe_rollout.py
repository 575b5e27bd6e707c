"""A tiny mixture-of-experts actor (FSDP over 2 ranks, so each rank trains half of every expert tensor) generating at
rollout.tp = 1 through the 3D-HybridEngine, with each ``algorithm.router_replay`` mode, on exact weights and with a
generation copy whose routers pick their experts from noisy probabilities (so the engine routes some tokens
elsewhere than training would, as tiny numeric differences do).

    torchrun --nproc-per-node 2 moe_rollout.py POLICY_DIR OUT_DIR

Two cases run again with the experts split over the two ranks (``actor.ep=2``), keyed ``ep2/<mode>:<perturbation>``:
the generation copy gathers each rank's experts into whole expert tensors; and the exact case with each expert's width
split over ``actor.tp=2``, generating at ``rollout.tp=1`` (``tp2/``: the micro-DP gather joins the two halves) and at
``rollout.tp=2`` (``tp2g2/``: the engine runs tensor-parallel experts).

Writes per case ``<mode>:<perturbation>`` the largest |rollout - recomputed| log-prob difference over response tokens,
the actor's ``rollout/log_prob_diff_max``, the routes' dtype, and whether an update ran; for ``off:0`` the largest
|generation copy - checkpoint| over the parameters (3-D experts included); for ``recompute`` the largest difference
between the old log-probs and a second pass that replays the routes the first recorded.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.models import load_model
from spmd_rlhf.models.moe import Routing, TopKRouter
from spmd_rlhf.runtime import ParallelDims, ResourcePool, data_parallel, launch, one_to_all
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from hybrid_generation import prompts_batch  # noqa: E402

PERTURBATION = 0.05
"""Standard deviation of the noise added to the router probabilities when the generation copy picks its experts
(the weights stay the exact probabilities at the picked experts): how a tiny numeric difference flips routing."""


def noisy_selection(router: torch.nn.Module, scale: float) -> None:
    """``router`` (a generation copy's) picks the top-k of its probabilities plus noise."""
    generator = torch.Generator().manual_seed(1)

    def forward(x: torch.Tensor) -> Routing:
        logits = F.linear(x, router.weight)
        probabilities = logits.softmax(-1, dtype=torch.float32)
        noise = scale * torch.randn(probabilities.shape, generator=generator)
        experts = (probabilities + noise).topk(router.top_k, dim=-1).indices
        weights = probabilities.gather(-1, experts)
        if router.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return Routing(logits, experts, weights.to(x.dtype))

    router.forward = forward


class InspectedActor(ActorWorker):
    perturbation = 0.0

    @one_to_all
    def set_perturbation(self, scale: float) -> None:
        self.perturbation = scale

    @data_parallel
    def generate_sequences(self, prompts: Batch, *, greedy: bool = False, samples: int | None = None) -> Batch:
        """The actor's own generation, from a copy whose routers pick their experts with ``perturbation`` noise."""
        model = self.hybrid.generation_model(getattr(torch, self.config.model.dtype))
        for module in model.modules():
            if isinstance(module, TopKRouter) and self.perturbation:
                noisy_selection(module, self.perturbation)
        return self.generator.generate(prompts, model, self.hybrid, greedy=greedy, samples=samples)

    @one_to_all
    def generation_copy_difference(self, policy_dir: str) -> dict:
        """The largest difference between the kept generation copy's parameters and the checkpoint's, and the names
        of the 3-D parameters it holds whole."""
        reference = dict(load_model(policy_dir).named_parameters())
        generation = {
            name: param.full_tensor() if isinstance(param, DTensor) else param
            for name, param in self.hybrid._kept.named_parameters()
        }
        assert generation.keys() == reference.keys()
        largest = max(float((generation[name] - reference[name]).abs().max().detach()) for name in reference)
        return {"max_difference": largest, "expert_tensors": sorted(n for n, p in generation.items() if p.ndim == 3)}


def run_case(
    coordinator, policy_dir: str, mode: str, perturbation: float, *, ep: int = 1, tp: int = 1, rollout_tp: int = 1
) -> dict:
    config = load_config(
        None,
        [
            f"model.path={policy_dir}",
            "model.dtype=float32",
            "algorithm.name=grpo",
            f"algorithm.router_replay='{mode}'",  # quoted: YAML 1.1 reads a bare off as false
            "critic.enabled=false",
            "rollout.n=2",
            "rollout.max_new_tokens=8",
            "rollout.temperature=0.8",
            "rollout.keep_engine=true",
            "rollout.recompute_log_probs=true",
            "data.batch_size=8",
            "actor.mini_batch_size=16",
            "actor.micro_batch_size=4",
            "actor.fsdp_unit_mb=0",
            f"actor.tp={tp}",
            f"rollout.tp={rollout_tp}",
        ],
    )
    name = f"actor_ep{ep}_tp{tp}_g{rollout_tp}_{mode}_{int(perturbation * 100)}"
    dims = ParallelDims(dp=2 // tp, ep=ep, tp=tp)
    actor = coordinator.spawn(InspectedActor, config, name=name, pool=ResourcePool([0, 1]), dims=dims)
    actor.set_perturbation(perturbation).result()
    rollout = actor.generate_sequences(prompts_batch(300)).result()
    result = {}
    if mode == "off" and not perturbation:  # (with ep=2 too: each rank's experts gathered whole)
        result["generation_copy"] = actor.generation_copy_difference(policy_dir).result()
    old = actor.compute_log_probs(rollout).result()
    rows, recomputed = rollout.fetch(), old.fetch()
    routes = (rows if mode == "rollout" else recomputed).tensors.get("routed_experts")
    result["routes"] = None if routes is None else {"dtype": str(routes.dtype), "shape": list(routes.shape)}
    if mode == "recompute":
        replayed = actor.compute_log_probs(Batch({**rows.tensors, **recomputed.tensors}, group_size=2)).result()
        again = (replayed.fetch()["old_log_probs"] - recomputed["old_log_probs"]).abs().max()
        result["replayed_recompute_difference"] = float(again)
    scores = Batch({"scores": torch.rand(len(rows), generator=torch.Generator().manual_seed(0))}, group_size=2)
    advantages = actor.compute_advantages(rollout, old, scores, estimator="grpo").result()
    mask = rows["response_mask"].bool()
    difference = (recomputed["old_log_probs"] - rows["rollout_log_probs"]).abs()[mask]
    metrics = actor.update_actor(rollout, old, advantages).result()
    result.update(
        max_difference=float(difference.max()),
        metric=advantages.meta["metrics"]["rollout/log_prob_diff_max"],
        tokens=int(mask.sum()),
        updated=all(torch.isfinite(torch.tensor(m["actor/loss"])) for m in metrics),
    )
    case = f"ep={ep} tp={tp} rollout.tp={rollout_tp} router_replay={mode} perturbation={perturbation}"
    print(f"{case}: rollout/log_prob_diff_max={result['metric']:.3g}")
    return result


def main(coordinator):
    policy_dir, out_dir = sys.argv[1:]
    results = {
        f"{mode}:{perturbation}": run_case(coordinator, policy_dir, mode, perturbation)
        for perturbation in (0.0, PERTURBATION)
        for mode in ("off", "rollout", "recompute")
    }
    for mode, perturbation in (("off", 0.0), ("rollout", PERTURBATION)):
        results[f"ep2/{mode}:{perturbation}"] = run_case(coordinator, policy_dir, mode, perturbation, ep=2)
    results["tp2/off:0.0"] = run_case(coordinator, policy_dir, "off", 0.0, tp=2)
    results["tp2g2/off:0.0"] = run_case(coordinator, policy_dir, "off", 0.0, tp=2, rollout_tp=2)
    with open(f"{out_dir}/results.json", "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    launch(main)
