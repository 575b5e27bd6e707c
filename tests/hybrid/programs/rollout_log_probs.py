"""The engine's log-probs of sampled tokens against the training forward's, through the distributed actor: FSDP dp=2 x
TP tp=2 training, generation at rollout.tp = 1 and 2 (the 3D-HybridEngine's reshard), in float32 and bfloat16.

    torchrun --nproc-per-node 4 rollout_log_probs.py POLICY_DIR OUT_DIR

Writes, per case ``<dtype>:tp_g<k>``, the largest difference over response tokens (computed here from the fetched
rows), the ``rollout/log_prob_diff_max`` metric the actor reports, and the largest |logit / T| the training forward saw
(the scale of the bf16 bound).
"""

import json
import sys

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.models import load_model
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from hybrid_generation import prompts_batch  # noqa: E402

TEMPERATURE = 0.8
CASES = [("float32", 1), ("float32", 2), ("bfloat16", 1), ("bfloat16", 2)]


def main(coordinator):
    policy_dir, out_dir = sys.argv[1:]
    results = {}
    for dtype, tp_g in CASES:
        config = load_config(
            None,
            [
                f"model.path={policy_dir}",
                f"model.dtype={dtype}",
                "algorithm.name=grpo",
                "critic.enabled=false",
                "rollout.n=2",
                "rollout.max_new_tokens=8",
                f"rollout.temperature={TEMPERATURE}",
                "rollout.top_k=50",
                f"rollout.tp={tp_g}",
                "actor.tp=2",
                "data.batch_size=8",
                "actor.mini_batch_size=16",
                "actor.micro_batch_size=4",
            ],
        )
        actor = coordinator.spawn(
            ActorWorker,
            config,
            name=f"actor_{dtype}_{tp_g}",
            pool=ResourcePool([0, 1, 2, 3]),
            dims=ParallelDims(dp=2, tp=2),
        )
        rollout = actor.generate_sequences(prompts_batch(300)).result()
        old = actor.compute_log_probs(rollout).result()
        rows, recomputed = rollout.fetch(), old.fetch()
        scores = Batch({"scores": torch.rand(len(rows), generator=torch.Generator().manual_seed(0))}, group_size=2)
        advantages = actor.compute_advantages(rollout, old, scores, estimator="grpo").result()
        mask = rows["response_mask"].bool()
        with torch.no_grad():
            logits = load_model(policy_dir)(rows["input_ids"], attention_mask=rows["attention_mask"])
        difference = (recomputed["old_log_probs"] - rows["rollout_log_probs"]).abs()[mask]
        results[f"{dtype}:tp_g{tp_g}"] = {
            "max_difference": float(difference.max()),
            "bitwise_equal": bool((difference == 0).all()),
            "metric": advantages.meta["metrics"]["rollout/log_prob_diff_max"],
            "tokens": int(mask.sum()),
            "min_log_prob": float(rows["rollout_log_probs"][mask].min()),
            "max_abs_logit": float(logits.abs().max()),
        }
    with open(f"{out_dir}/results.json", "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    launch(main)
