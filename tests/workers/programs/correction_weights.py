"""update_actor on one batch whose engine log-probs differ from the recomputed ones in known ways, one fresh actor per
run (one rank, one mini-batch, one PPO epoch: the loss and gradient norm are those of the initial weights); each run's
metrics go to OUT_DIR/<run>.json.

    torchrun --nproc-per-node 1 correction_weights.py MODEL_DIR OUT_DIR
"""

import json
import math
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker

ROWS, PROMPT, RESPONSE = 16, 5, 6


def rollout_batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 100, (ROWS, PROMPT), generator=generator)
    lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=generator)
    response_mask = (torch.arange(RESPONSE)[None] < lengths[:, None]).long()
    responses = torch.randint(5, 100, (ROWS, RESPONSE), generator=generator) * response_mask
    old_log_probs = -torch.rand(ROWS, RESPONSE, generator=generator) * 3 * response_mask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.long), response_mask], dim=1),
            "old_log_probs": old_log_probs,
            "rollout_log_probs": old_log_probs,
            "advantages": torch.randn(ROWS, RESPONSE, generator=generator) * response_mask,
        },
        group_size=2,
    )


def with_gap(batch: Batch, gap: torch.Tensor) -> Batch:
    """``batch`` with engine log-probs ``gap`` below the recomputed ones (pi_old / mu = exp(gap))."""
    tensors = dict(batch.tensors)
    tensors["rollout_log_probs"] = (batch["old_log_probs"] - gap) * batch["response_mask"]
    return Batch(tensors, group_size=batch.group_size)


def main(coordinator):
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    batch = rollout_batch()
    mask = batch["response_mask"].float()
    lengths = mask.sum(dim=1, keepdim=True)
    first_half = (torch.arange(ROWS) < ROWS // 2)[:, None].float()
    gaps = {
        "same": torch.zeros(ROWS, RESPONSE),
        "token_1.5": torch.full((ROWS, RESPONSE), math.log(1.5)),
        "token_3": torch.full((ROWS, RESPONSE), math.log(3.0)),  # truncated at 2
        "sequence_1.2": math.log(1.2) / lengths.expand(ROWS, RESPONSE),  # each response's product is 1.2
        "first_half_3": first_half * math.log(3.0),  # rejected by a token or sequence mask at [0.5, 2]
    }
    runs = {
        # name: (policy loss, correction overrides, gap, rows kept)
        "ppo_same": ("ppo", [], "same", None),
        "ppo_token_1.5": ("ppo", [], "token_1.5", None),
        "ppo_token_3": ("ppo", [], "token_3", None),
        "ppo_sequence_1.2": ("ppo", ["is_level=sequence"], "sequence_1.2", None),
        "ppo_geometric_1.5": ("ppo", ["is_level=geometric"], "token_1.5", None),
        "ppo_token_rs": ("ppo", ["preset=token_rs"], "first_half_3", None),
        "ppo_seq_rs": ("ppo", ["preset=seq_rs"], "first_half_3", None),
        "ppo_second_half": ("ppo", [], "same", slice(ROWS // 2, ROWS)),
        "ppo_disabled_3": ("ppo", ["preset=disabled"], "token_3", None),
        **{f"{loss}_same": (loss, [], "same", None) for loss in ("gspo", "cispo", "gmpo", "sapo")},
        **{f"{loss}_token_1.5": (loss, [], "token_1.5", None) for loss in ("gspo", "cispo", "gmpo", "sapo")},
    }
    for name, (loss, correction, gap, rows) in runs.items():
        run_batch = with_gap(batch, gaps[gap])
        if rows is not None:
            run_batch = run_batch.slice(rows.start, rows.stop, group_size=2)
        config = load_config(
            None,
            [
                f"model.path={model_dir}",
                "algorithm.name=grpo",
                f"algorithm.policy_loss={loss}",
                "critic.enabled=false",
                "reference.enabled=false",
                "algorithm.kl_penalty=none",
                "rollout.n=2",
                f"rollout.max_new_tokens={RESPONSE}",
                f"actor.mini_batch_size={len(run_batch)}",
                "actor.micro_batch_size=4",
                "actor.ppo_epochs=1",
                f"data.batch_size={len(run_batch) // 2}",
                f"data.max_prompt_length={PROMPT}",
                *(f"algorithm.correction.{item}" for item in correction),
            ],
        )
        actor = coordinator.spawn(
            ActorWorker, config, name=f"actor_{name}", pool=ResourcePool([0]), dims=ParallelDims()
        )
        (metrics,) = actor.update_actor(run_batch).result()
        (out_dir / f"{name}.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    launch(main)
