"""A tiny mixture-of-experts actor under expert and tensor parallelism on the same ranks, against one rank: layouts
``dp{dp}ep{ep}tp{tp}pp{pp}`` such as dp2ep2tp1pp1, dp4ep2tp1pp1 (experts FSDP-sharded over efsdp = 2 as well),
dp2ep1tp2pp1 (each expert's width split over tp) or dp2ep2tp2pp1 (both; dp2ep2tp2pp1sp: with sequence parallelism
too). Each layout computes log-probs, takes two updates (metrics: loss and gradient norm of each) and saves its
weights (experts included); before them, without pipeline stages, it writes every parameter's whole gradient of the
summed response log-probs (the router's included, which the update's metrics hardly feel). Then, when both were run,
the dp2ep2 actor's DCP checkpoint is resumed by a dp4ep4 actor, and both take one more update.

    torchrun --nproc-per-node 4 expert_parallel_parity.py POLICY_DIR OUT_DIR dp1ep1tp1pp1 dp2ep2tp1pp1 ...
"""

import json
import re
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch, one_to_all
from spmd_rlhf.workers import ActorWorker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_parity import rollout_batch  # noqa: E402


class GradientActor(ActorWorker):
    @one_to_all
    def save_log_prob_gradients(self, tensors: dict[str, torch.Tensor], path: str) -> None:
        """Every parameter's whole gradient of the sum of all rows' response log-probs (each DP rank takes its
        contiguous share of the rows), written to ``path`` by role rank 0 and zeroed again."""
        batch = Batch(tensors, group_size=2)
        dims, where = self.context.dims, self.context.coordinates
        share = len(batch) // dims.dp
        mine = batch.select(list(range(where.dp * share, (where.dp + 1) * share)))
        model = self.model

        def summed(logits: torch.Tensor, micro) -> torch.Tensor:
            # FSDP averages gradients over dp: scaled so that the average is the sum over all rows.
            return model.response_log_probs(logits, micro, self.temperature)[0].sum() * dims.dp

        model.module.train()
        model.run_model(mine, micro_batch_size=2, output_fn=summed, train=True)
        gradients = {}
        for name, param in model.module.named_parameters():
            gradient = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            gradients[name] = gradient.detach().clone()
        model.module.zero_grad(set_to_none=True)
        if self.context.role_rank == 0:
            torch.save(gradients, path)


def main(coordinator):
    policy_dir, out_dir, *layouts = sys.argv[1:]
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
        # The routers' losses are per micro-batch, so they differ between data-parallel layouts; expert
        # parallelism changes nothing about them (each rank routes its own tokens, as under dp).
        "actor.router_aux_loss_coef=0",
    ]
    config = load_config(None, overrides)
    batch = rollout_batch(16, 5, 6, vocab=100)
    actors = {}
    for layout in layouts:
        *sizes, split = re.fullmatch(r"dp(\d+)ep(\d+)tp(\d+)pp(\d+)(?:fsdp(\d+))?(sp)?", layout).groups()
        dp, ep, tp, pp, fsdp = (int(size or 0) for size in sizes)
        pool, dims = ResourcePool(range(dp * tp * pp)), ParallelDims(pp=pp, dp=dp, tp=tp, ep=ep, fsdp_size=fsdp)
        role_config = load_config(None, [*overrides, "actor.sequence_parallel=true"]) if split else config
        actor = coordinator.spawn(GradientActor, role_config, name=f"actor_{layout}", pool=pool, dims=dims)
        torch.save(actor.compute_log_probs(batch).result().fetch()["old_log_probs"], f"{out_dir}/{layout}.pt")
        if pp == 1:
            actor.save_log_prob_gradients(batch.tensors, f"{out_dir}/{layout}_gradients.pt").result()
        metrics = [actor.update_actor(batch).result() for _ in range(2)]
        Path(f"{out_dir}/{layout}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/{layout}_actor").result()
        actors[layout] = actor
    if "dp2ep2tp1pp1" in actors:
        saved = actors["dp2ep2tp1pp1"]
        saved.save_checkpoint(f"{out_dir}/checkpoint").result()
        resumed = coordinator.spawn(
            ActorWorker, config, name="resumed", pool=ResourcePool(range(4)), dims=ParallelDims(dp=4, ep=4)
        )
        resumed.load_checkpoint(f"{out_dir}/checkpoint").result()
        resumed.save_pretrained(f"{out_dir}/resumed_actor").result()
        metrics = {"saved": saved.update_actor(batch).result(), "resumed": resumed.update_actor(batch).result()}
        Path(f"{out_dir}/resume.json").write_text(json.dumps(metrics))
        saved.save_pretrained(f"{out_dir}/saved_next").result()
        resumed.save_pretrained(f"{out_dir}/resumed_next").result()


if __name__ == "__main__":
    launch(main)
