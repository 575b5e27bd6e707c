"""Every role under context parallelism on the same ranks, against one rank: layouts ``dp{dp}cp{cp}tp{tp}`` such as
dp2cp2tp1, dp4cp4tp1 (grouped-query attention: 2 key/value heads replicated to 4), dp4cp2tp1 (two cp groups) and
dp2cp2tp2 (with tensor parallelism); a ``ring`` suffix (dp4cp4tp1ring, dp2cp2tp2ring) sets every role's
``cp_attention=ring`` (zig-zag chunks, keys and values around the ring); a ``pp`` part (dp2cp2tp1pp2ring) runs
every role through a pipeline of that many stages. Each layout computes the actor's log-probs and (without a
pipeline) every parameter's gradient of their sum, the critic's values and the reward model's scores, then takes two
actor updates (KL and entropy terms) and one critic update, and saves the actor's updated weights. Last, an actor at
dp2cp2tp1 whose micro-batch token budget (6) holds only half of the longest row (11 tokens) takes the same two
updates.

    torchrun --nproc-per-node 4 context_parallel_parity.py POLICY_DIR CRITIC_DIR REWARD_DIR OUT_DIR dp1cp1tp1 ...
"""

import json
import re
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker, CriticWorker, RewardWorker

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dp_parity import rollout_batch, with_value_targets  # noqa: E402
from expert_parallel_parity import GradientActor  # noqa: E402


def main(coordinator):
    policy_dir, critic_dir, reward_dir, out_dir, *layouts = sys.argv[1:]
    overrides = [
        f"model.path={policy_dir}",
        "algorithm.name=ppo",
        "algorithm.kl_penalty=loss",
        "algorithm.entropy_coef=0.01",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "data.batch_size=8",
        "data.max_prompt_length=5",
        "actor.lr=1e-3",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=2",
        "actor.forward_micro_batch_size=2",
        "actor.fsdp_unit_mb=0",
        f"critic.model_path={critic_dir}",
        "critic.lr=1e-3",
        "critic.mini_batch_size=16",
        "critic.micro_batch_size=2",
        "reward.kind=model",
        f"reward.model_path={reward_dir}",
        "reward.micro_batch_size=2",
    ]
    batch = with_value_targets(rollout_batch(16, 5, 6, vocab=100))
    for layout in layouts:
        sizes = re.fullmatch(r"dp(\d+)cp(\d+)tp(\d+)(?:pp(\d+))?(?:fsdp(\d+))?(ring)?(sp)?", layout).groups()
        dp, cp, tp, pp, fsdp, ring, split = sizes
        dp, cp, tp, pp, fsdp = int(dp), int(cp), int(tp), int(pp or 1), int(fsdp or 0)
        roles = ("actor", "critic", "reward")
        attention = [f"{role}.cp_attention=ring" for role in roles] if ring else []
        attention += [f"{role}.sequence_parallel=true" for role in roles] if split else []
        config = load_config(None, [*overrides, *attention])
        pool, dims = ResourcePool(range(dp * tp * pp)), ParallelDims(pp=pp, dp=dp, tp=tp, cp=cp, fsdp_size=fsdp)
        actor = coordinator.spawn(GradientActor, config, name=f"actor_{layout}", pool=pool, dims=dims)
        critic = coordinator.spawn(CriticWorker, config, name=f"critic_{layout}", pool=pool, dims=dims)
        reward = coordinator.spawn(RewardWorker, config, name=f"reward_{layout}", pool=pool, dims=dims)
        results = {
            "log_probs": actor.compute_log_probs(batch).result().fetch()["old_log_probs"],
            "values": critic.compute_values(batch).result().fetch()["values"],
            "scores": reward.compute_rewards(batch).result().fetch()["scores"],
        }
        torch.save(results, f"{out_dir}/{layout}.pt")
        if pp == 1:  # (through a pipeline, rank 0 holds the first stage's gradients only)
            actor.save_log_prob_gradients(batch.tensors, f"{out_dir}/{layout}_gradients.pt").result()
        metrics = {
            "actor": [actor.update_actor(batch).result() for _ in range(2)],
            "critic": [critic.update_critic(batch).result()],
        }
        Path(f"{out_dir}/{layout}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/{layout}_actor").result()
    budget = load_config(None, [*overrides, "actor.cp=2", "actor.max_tokens_per_micro_batch=6"])
    long = coordinator.spawn(
        ActorWorker, budget, name="actor_budget", pool=ResourcePool(range(2)), dims=ParallelDims(dp=2, cp=2)
    )
    Path(f"{out_dir}/budget.json").write_text(json.dumps([long.update_actor(batch).result() for _ in range(2)]))


if __name__ == "__main__":
    launch(main)
