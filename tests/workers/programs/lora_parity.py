"""A LoRA actor under several (dp, tp[, pp]) layouts on the same ranks, against the single-rank layout: log-probs with
the adapters on and off (the reference), two updates, the trained adapters, generation with the adapters merged into the
generation weights (rollout log-probs against training log-probs), and a checkpoint saved by (dp, tp) = (2, 2)
resumed by (4, 1).

    torchrun --nproc-per-node 4 lora_parity.py POLICY_DIR OUT_DIR dp1tp1 dp2tp2 dp4tp1 dp1tp2pp2
"""

import json
import re
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.models import load_model
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
sys.path.insert(0, str(Path(__file__).parents[2] / "hybrid" / "programs"))
from dp_parity import rollout_batch  # noqa: E402
from hybrid_generation import prompts_batch  # noqa: E402


def main(coordinator):
    policy_dir, out_dir, *layouts = sys.argv[1:]
    config = load_config(
        None,
        [
            f"model.path={policy_dir}",
            "algorithm.name=grpo",
            "critic.enabled=false",
            "reference.enabled=false",
            "algorithm.kl_penalty=loss",
            "rollout.n=2",
            "rollout.max_new_tokens=6",
            "rollout.temperature=0.8",
            "data.batch_size=8",
            "data.max_prompt_length=6",
            "actor.lr=2e-2",
            "actor.mini_batch_size=16",
            "actor.micro_batch_size=2",
            "actor.fsdp_unit_mb=0",
            "actor.lora.rank=4",
            "actor.lora.alpha=8",
            "actor.lora.target_modules=[all-linear]",
        ],
    )
    batch = rollout_batch(16, 5, 6, vocab=100)
    response_length = batch["responses"].shape[1]
    with torch.no_grad():
        logits = load_model(policy_dir)(batch["input_ids"], attention_mask=batch["attention_mask"]).float()
    log_probs = torch.log_softmax(logits[:, -response_length - 1 : -1] / 0.8, dim=-1)
    base = log_probs.gather(-1, batch["responses"][..., None]).squeeze(-1) * batch["response_mask"]
    torch.save(base, f"{out_dir}/base.pt")
    actors = {}
    for layout in layouts:
        dp, tp, pp = (int(size) for size in re.fullmatch(r"dp(\d+)tp(\d+)(?:pp(\d+))?", layout).groups(default="1"))
        actor = coordinator.spawn(
            ActorWorker,
            config,
            name=f"actor_{layout}",
            pool=ResourcePool(range(dp * tp * pp)),
            dims=ParallelDims(pp=pp, dp=dp, tp=tp),
        )
        results = {"initial": actor.compute_log_probs(batch).result().fetch()["old_log_probs"]}
        metrics = [actor.update_actor(batch).result() for _ in range(2)]
        results["trained"] = actor.compute_log_probs(batch).result().fetch()["old_log_probs"]
        results["reference"] = actor.compute_ref_log_probs(batch).result().fetch()["ref_log_probs"]
        rollout = actor.generate_sequences(prompts_batch(300)).result()
        rows, recomputed = rollout.fetch(), actor.compute_log_probs(rollout).result().fetch()
        mask = rows["response_mask"].bool()
        results["rollout_difference"] = (recomputed["old_log_probs"] - rows["rollout_log_probs"]).abs()[mask].max()
        results["rollout_tokens"] = mask.sum()
        torch.save(results, f"{out_dir}/{layout}.pt")
        Path(f"{out_dir}/{layout}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/{layout}_adapter").result()
        actors[layout] = actor
    saved = actors["dp2tp2"]
    saved.save_checkpoint(f"{out_dir}/checkpoint").result()
    resumed = coordinator.spawn(
        ActorWorker, config, name="resumed", pool=ResourcePool(range(4)), dims=ParallelDims(dp=4, tp=1)
    )
    resumed.load_checkpoint(f"{out_dir}/checkpoint").result()
    metrics = {"saved": saved.update_actor(batch).result(), "resumed": resumed.update_actor(batch).result()}
    Path(f"{out_dir}/resume.json").write_text(json.dumps(metrics))
    saved.save_pretrained(f"{out_dir}/saved_next").result()
    resumed.save_pretrained(f"{out_dir}/resumed_next").result()


if __name__ == "__main__":
    launch(main)
