"""A tiny mixture-of-experts actor (FSDP over 2 ranks, so each rank trains half of every expert tensor) generating at
rollout.tp = 1 through the 3D-HybridEngine: the generation copy against the checkpoint, and the rollout log-probs
against the training forward's.

    torchrun --nproc-per-node 2 moe_rollout.py POLICY_DIR OUT_DIR

Writes per case the largest |generation copy - checkpoint| over the parameters (3-D experts included), the largest
|rollout - recomputed| log-prob difference over response tokens and the actor's ``rollout/log_prob_diff_max``.
"""

import json
import sys

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.models import load_model
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch, one_to_all
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from hybrid_generation import prompts_batch  # noqa: E402


class InspectedActor(ActorWorker):
    @one_to_all
    def generation_copy_difference(self, policy_dir: str) -> dict:
        """The largest difference between the kept generation copy's parameters and the checkpoint's, and the names
        of the 3-D parameters it holds whole."""
        reference = dict(load_model(policy_dir).named_parameters())
        generation = dict(self.hybrid._kept.named_parameters())
        assert generation.keys() == reference.keys()
        largest = max(float((generation[name] - reference[name]).abs().max()) for name in reference)
        return {"max_difference": largest, "expert_tensors": sorted(n for n, p in generation.items() if p.ndim == 3)}


def main(coordinator):
    policy_dir, out_dir = sys.argv[1:]
    config = load_config(
        None,
        [
            f"model.path={policy_dir}",
            "model.dtype=float32",
            "algorithm.name=grpo",
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
        ],
    )
    actor = coordinator.spawn(InspectedActor, config, name="actor", pool=ResourcePool([0, 1]), dims=ParallelDims(dp=2))
    rollout = actor.generate_sequences(prompts_batch(300)).result()
    copy = actor.generation_copy_difference(policy_dir).result()
    old = actor.compute_log_probs(rollout).result()
    rows, recomputed = rollout.fetch(), old.fetch()
    scores = Batch({"scores": torch.rand(len(rows), generator=torch.Generator().manual_seed(0))}, group_size=2)
    advantages = actor.compute_advantages(rollout, old, scores, estimator="grpo").result()
    mask = rows["response_mask"].bool()
    difference = (recomputed["old_log_probs"] - rows["rollout_log_probs"]).abs()[mask]
    results = {
        "generation_copy": copy,
        "max_difference": float(difference.max()),
        "metric": advantages.meta["metrics"]["rollout/log_prob_diff_max"],
        "tokens": int(mask.sum()),
    }
    with open(f"{out_dir}/results.json", "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    launch(main)
