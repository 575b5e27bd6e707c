"""update_actor on one batch by actors on the same 4 ranks: dp=1, 2, 4, dp=1 with larger micro-batches, and
token-budget micro-batches (dp=2 at the smallest budget, where the two DP ranks' rows need different micro-batch
counts, and dp=1 at a larger one); each saves its weights and metrics, in ``OUT_DIR/AGGREGATION`` for each loss
aggregation named (one job runs them all, one after another).

    torchrun --nproc-per-node 4 dp_parity.py MODEL_DIR OUT_DIR token_mean seq_mean_token_mean
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from spmd_rlhf.config import load_config
from spmd_rlhf.data import Batch
from spmd_rlhf.runtime import ParallelDims, ResourcePool, launch
from spmd_rlhf.workers import ActorWorker


def rollout_batch(rows: int, prompt_length: int, response_length: int, vocab: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, vocab, (rows, prompt_length), generator=generator)
    prompt_mask = torch.ones(rows, prompt_length, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # some left padding
    lengths = torch.randint(1, response_length + 1, (rows,), generator=generator)
    response_mask = (torch.arange(response_length)[None] < lengths[:, None]).long()
    responses = torch.randint(5, vocab, (rows, response_length), generator=generator) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "old_log_probs": -torch.rand(rows, response_length, generator=generator) * 3,
            "ref_log_probs": -torch.rand(rows, response_length, generator=generator) * 3,
            "advantages": torch.randn(rows, response_length, generator=generator) * response_mask,
        },
        group_size=2,
    )


def with_value_targets(batch: Batch) -> Batch:
    """``batch`` with random ``values`` and ``returns`` at its response positions, for a critic's update."""
    generator = torch.Generator().manual_seed(1)
    mask = batch["response_mask"].float()
    shape = mask.shape
    targets = {name: torch.randn(shape, generator=generator) * mask for name in ("values", "returns")}
    return batch.union(Batch(targets, group_size=batch.group_size))


def argument_sets(arguments: list[str]) -> list[list[str]]:
    """A program's arguments split at each ``+``: the sets of models one job runs one after another (so a test's
    second model starts no ranks of its own)."""
    sets: list[list[str]] = [[]]
    for argument in arguments:
        if argument == "+":
            sets.append([])
        else:
            sets[-1].append(argument)
    return sets


def main(coordinator):
    model_dir, out_dir, *aggregations = sys.argv[1:]
    for aggregation in aggregations:
        Path(out_dir, aggregation).mkdir()
        update_in_layouts(coordinator, model_dir, f"{out_dir}/{aggregation}", aggregation)


def update_in_layouts(coordinator, model_dir: str, out_dir: str, aggregation: str) -> None:
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "algorithm.name=grpo",
            "algorithm.kl_penalty=loss",
            "algorithm.entropy_coef=0.01",
            f"algorithm.loss_aggregation={aggregation}",
            "critic.enabled=false",
            "rollout.n=2",
            "rollout.max_new_tokens=6",
            "actor.lr=1e-3",
            "actor.mini_batch_size=16",
            "actor.micro_batch_size=2",
            "actor.ppo_epochs=2",
            "data.batch_size=8",
            "data.max_prompt_length=5",
        ],
    )
    batch = rollout_batch(16, 5, 6, vocab=100)
    # dp=1 with micro-batches of 2, dp=2 and dp=4 with 2, and dp=1 with micro-batches of 8 rows.
    runs = {
        "dp1": (1, config),
        "dp2": (2, config),
        "dp4": (4, config),
        "dp1_micro8": (1, dataclasses.replace(config, actor=dataclasses.replace(config.actor, micro_batch_size=8))),
        # Rows of 4 to 11 tokens under budgets of 11 (the longest row) and 30 tokens per micro-batch.
        "dp2_tokens11": (
            2,
            dataclasses.replace(config, actor=dataclasses.replace(config.actor, max_tokens_per_micro_batch=11)),
        ),
        "dp1_tokens30": (
            1,
            dataclasses.replace(config, actor=dataclasses.replace(config.actor, max_tokens_per_micro_batch=30)),
        ),
        # The tiny model is one FSDP unit by default; here one unit per layer, each gathered once and its gradient
        # reduce-scattered once per mini-batch (actor.unsharded_accumulation_mb), or in every micro-batch (0).
        "dp2_unit_per_layer": (2, dataclasses.replace(config, actor=dataclasses.replace(config.actor, fsdp_unit_mb=0))),
        "dp2_unit_per_layer_per_micro_batch": (
            2,
            dataclasses.replace(
                config, actor=dataclasses.replace(config.actor, fsdp_unit_mb=0, unsharded_accumulation_mb=0)
            ),
        ),
    }
    for name, (dp, run_config) in runs.items():
        actor = coordinator.spawn(
            ActorWorker,
            run_config,
            name=f"actor_{aggregation}_{name}",
            pool=ResourcePool(range(dp)),
            dims=ParallelDims(dp=dp),
        )
        # Forward rows come back in the batch's row order however the micro-batches grouped them.
        torch.save(actor.compute_log_probs(batch).result().fetch()["old_log_probs"], f"{out_dir}/{name}_log_probs.pt")
        metrics = actor.update_actor(batch).result()  # one dict per DP rank
        Path(f"{out_dir}/{name}.json").write_text(json.dumps(metrics))
        actor.save_pretrained(f"{out_dir}/{name}").result()


if __name__ == "__main__":
    launch(main)
