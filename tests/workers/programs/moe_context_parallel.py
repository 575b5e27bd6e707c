"""A tiny mixture-of-experts actor under context parallelism on 2 ranks, against the same 2 ranks without it:
layouts ``dp2cp1`` (the reference), ``dp2cp2`` (Ulysses), ``dp2cp2ring`` and ``dp2cp2ep2`` (the experts split over
the same ranks as the row). The routers' load-balancing and z losses are on. With ``algorithm.router_replay=rollout``
each layout computes log-probs of rows without recorded experts and of the same rows carrying random recorded experts
(``routed_experts``: replayed), every parameter's gradient of the replayed summed log-probs, two updates on the
replayed rows (loss, gradient norm and the routers' metrics), and saves its weights; with ``recompute`` (the reference
and ring) it records the experts of the log-prob pass (``routed_experts`` gathered from the ranks' chunks).

    torchrun --nproc-per-node 2 moe_context_parallel.py POLICY_DIR OUT_DIR dp2cp1 dp2cp2 ...
"""

import json
import re
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_parity import rollout_batch  # noqa: E402
from expert_parallel_parity import GradientActor  # noqa: E402


def with_random_routes(batch: Batch, moe_layers: int, experts: int, top_k: int) -> Batch:
    """``batch`` carrying random distinct experts per token (-1 where ``attention_mask`` is 0)."""
    rows, length = batch["input_ids"].shape
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(rows, length, moe_layers, experts, generator=generator)
    routes = scores.topk(top_k, dim=-1).indices.to(torch.int8)
    routes[~batch["attention_mask"].bool()] = -1
    return batch.union(Batch({"routed_experts": routes}, group_size=batch.group_size))


def main(coordinator):
    policy_dir, out_dir, *layouts = sys.argv[1:]
    model = json.loads((Path(policy_dir) / "config.json").read_text())
    overrides = [
        f"model.path={policy_dir}",
        "algorithm.name=grpo",
        "algorithm.kl_penalty=loss",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "data.batch_size=8",
        "data.max_prompt_length=5",
        "actor.lr=1e-3",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=2",
        "actor.forward_micro_batch_size=2",
        "actor.fsdp_unit_mb=0",
        "actor.router_aux_loss_coef=0.1",
        "actor.router_z_loss_coef=0.01",
    ]
    batch = rollout_batch(16, 5, 6, vocab=100)
    replayed = with_random_routes(
        batch, model["num_hidden_layers"], model["num_local_experts"], model["num_experts_per_tok"]
    )
    for layout in layouts:
        cp, ring, ep = re.fullmatch(r"dp2cp(\d)(ring)?(?:ep(\d))?", layout).groups()
        dims = ParallelDims(dp=2, cp=int(cp), ep=int(ep or 1))
        attention = ["actor.cp_attention=ring"] if ring else []
        config = load_config(None, [*overrides, *attention, "algorithm.router_replay=rollout"])
        actor = coordinator.spawn(GradientActor, config, name=f"actor_{layout}", pool=ResourcePool(range(2)), dims=dims)
        results = {
            "own": actor.compute_log_probs(batch).result().fetch()["old_log_probs"],
            "replayed": actor.compute_log_probs(replayed).result().fetch()["old_log_probs"],
        }
        actor.save_log_prob_gradients(replayed.tensors, f"{out_dir}/{layout}_gradients.pt").result()
        metrics = [actor.update_actor(replayed).result() for _ in range(2)]
        Path(f"{out_dir}/{layout}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/{layout}_actor").result()
        if cp == "1" or ring:  # the reference, and the zig-zag chunks whose experts come back out of row order
            recording = load_config(
                None, [*overrides, *attention, "algorithm.router_replay=recompute", "rollout.recompute_log_probs=true"]
            )
            recorder = coordinator.spawn(
                ActorWorker, recording, name=f"recorder_{layout}", pool=ResourcePool(range(2)), dims=dims
            )
            results["recorded"] = recorder.compute_log_probs(batch).result().fetch()["routed_experts"]
        torch.save(results, f"{out_dir}/{layout}.pt")


if __name__ == "__main__":
    launch(main)
