"""Every role under several (dp, tp, pp) layouts on the same ranks, against the single-rank layout: the actor's
log-probs and one update_actor (two PPO epochs, KL and entropy terms), the critic's values and one update_critic,
and a reward model's scores. Each layout saves its results, metrics and updated weights.

Then the (dp, tp, pp) = (2, 2, 1) actor's DCP checkpoint (with ``dp2tp2pp1fsdp1``, that HSDP actor's: two replicas of
unsharded TP shards) is resumed by a (1, 2, 2) actor and both take one more step.

    torchrun --nproc-per-node 4 parallel_parity.py POLICY_DIR CRITIC_DIR REWARD_DIR OUT_DIR dp1tp1pp1 dp2tp2pp1 ... \\
        [+ POLICY_DIR CRITIC_DIR REWARD_DIR OUT_DIR dp1tp1pp1 ...]

Each ``+`` starts another set of models with its own output directory and layouts, run after the one before in the
same job (the tests run a tied model beside the untied ones without starting the ranks twice).
"""

import json
import re
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch, one_to_all
from spmd_rlhf.workers import ActorWorker, CriticWorker, RewardWorker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_parity import argument_sets, rollout_batch, with_value_targets  # noqa: E402

LAYOUT = r"dp(\d+)tp(\d+)pp(\d+)(?:fsdp(\d+))?(sp)?"
"""A layout's name: its sizes, with ``fsdp`` FSDP's shard group below dp (HSDP), with ``sp`` every role's
sequence parallelism."""


class ProbedActor(ActorWorker):
    """The actor, saying how FSDP laid out one of its decoder weights (on its first rank)."""

    @one_to_all
    def fsdp_layout(self) -> dict:
        weight = next(p for name, p in self.model.module.named_parameters() if name.endswith("mlp.down_proj.weight"))
        return {
            "dims": list(weight.device_mesh.mesh_dim_names),
            "placements": [repr(placement) for placement in weight.placements],
            "local_fraction": weight.to_local().numel() / weight.numel(),
        }


def main(coordinator):
    for number, arguments in enumerate(argument_sets(sys.argv[1:])):
        run_models(coordinator, *arguments, prefix=f"set{number}_")


def run_models(
    coordinator, policy_dir: str, critic_dir: str, reward_dir: str, out_dir: str, *layouts: str, prefix: str
) -> None:
    """One set of models in ``layouts``; ``prefix`` keeps its roles' names apart from another set's."""
    overrides = [
        f"model.path={policy_dir}",
        "algorithm.name=ppo",
        "algorithm.kl_penalty=loss",
        "algorithm.entropy_coef=0.01",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "data.batch_size=8",
        "actor.lr=1e-3",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=2",
        "actor.ppo_epochs=2",
        "actor.forward_micro_batch_size=4",
        f"critic.model_path={critic_dir}",
        "critic.lr=1e-3",
        "critic.mini_batch_size=16",
        "critic.micro_batch_size=4",
        "critic.pp_schedule=gpipe",
        "critic.max_tokens_per_micro_batch=24",
        "data.max_prompt_length=5",
        "actor.max_tokens_per_micro_batch=200",
        "reward.kind=model",
        f"reward.model_path={reward_dir}",
        "reward.micro_batch_size=2",
        # FSDP units: the actor one per layer; the critic's layers (0.06 MiB each, less under TP) in runs of 2 or 4,
        # or all in the root when they fall short; the reward model (default bound) the root alone.
        "actor.fsdp_unit_mb=0",
        "critic.fsdp_unit_mb=0.1",
    ]
    config = load_config(None, overrides)
    # Under HSDP the critic reduce-scatters every micro-batch's gradients (as a model too large to keep them unsharded
    # does), all-reducing them across the replicas once, in the last backward.
    hybrid_config = load_config(None, [*overrides, "critic.unsharded_accumulation_mb=0"])
    roles = ("actor", "critic", "reward")
    sequence_parallel = [f"{role}.{key}" for role in roles for key in ("tp=2", "sequence_parallel=true")]
    split_config = load_config(None, [*overrides, *sequence_parallel])  # tp as the layouts with sp have it
    batch = with_value_targets(rollout_batch(16, 5, 6, vocab=100))
    actors = {}
    for layout in layouts:
        *sizes, split = re.fullmatch(LAYOUT, layout).groups()
        dp, tp, pp, fsdp = (int(size or 0) for size in sizes)
        pool, dims = ResourcePool(range(dp * tp * pp)), ParallelDims(pp=pp, dp=dp, tp=tp, fsdp_size=fsdp)
        role_config = split_config if split else config
        actor = coordinator.spawn(ProbedActor, role_config, name=f"{prefix}actor_{layout}", pool=pool, dims=dims)
        critic_config = hybrid_config if fsdp else role_config
        critic = coordinator.spawn(CriticWorker, critic_config, name=f"{prefix}critic_{layout}", pool=pool, dims=dims)
        reward = coordinator.spawn(RewardWorker, role_config, name=f"{prefix}reward_{layout}", pool=pool, dims=dims)
        results = {
            "log_probs": actor.compute_log_probs(batch).result().fetch()["old_log_probs"],
            "values": critic.compute_values(batch).result().fetch()["values"],
            "scores": reward.compute_rewards(batch).result().fetch()["scores"],
        }
        torch.save(results, f"{out_dir}/{layout}.pt")
        metrics = {"actor": actor.update_actor(batch).result(), "critic": critic.update_critic(batch).result()}
        metrics["fsdp_layout"] = actor.call("fsdp_layout").result()
        Path(f"{out_dir}/{layout}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/{layout}_actor").result()
        critic.save_pretrained(f"{out_dir}/{layout}_critic").result()
        actors[layout] = actor
    saved_layout = "dp2tp2pp1fsdp1" if "dp2tp2pp1fsdp1" in actors else "dp2tp2pp1"
    if saved_layout in actors and "dp1tp2pp2" in actors:
        # A sharded checkpoint of the trained actor in one layout (HSDP's replicas where there is one), resumed in
        # another (tp and pp both change).
        saved = actors[saved_layout]
        saved.save_checkpoint(f"{out_dir}/checkpoint").result()
        resumed = coordinator.spawn(
            ActorWorker,
            config,
            name=f"{prefix}resumed",
            pool=ResourcePool(range(4)),
            dims=ParallelDims(pp=2, dp=1, tp=2),
        )
        resumed.load_checkpoint(f"{out_dir}/checkpoint").result()
        resumed.save_pretrained(f"{out_dir}/resumed_actor").result()
        # The next update from the restored weights and optimizer state equals the uninterrupted one.
        metrics = {"saved": saved.update_actor(batch).result(), "resumed": resumed.update_actor(batch).result()}
        Path(f"{out_dir}/resume.json").write_text(json.dumps(metrics))
        saved.save_pretrained(f"{out_dir}/saved_next").result()
        resumed.save_pretrained(f"{out_dir}/resumed_next").result()


if __name__ == "__main__":
    launch(main)
