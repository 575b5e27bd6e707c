"""DAPO's dynamic sampling: a step's rollouts with every prompt whose samples all scored the same dropped (no
group-relative signal) and the batch refilled from further prompts."""

from __future__ import annotations

import torch

from spmd_rlhf.algos import groups_with_signal
from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.controller.role_handles import ActorHandle, RewardHandle
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.data.dataset import PromptLoader
from spmd_rlhf.metrics.step_metrics import StageTimer
from spmd_rlhf.runtime import BatchRef


def left_pad(prompts: Batch, *, width: int, pad_token_id: int) -> Batch:
    """``prompts`` left-padded to ``width`` tokens, so rollouts of different prompt batches can be concatenated."""
    extra = width - prompts["input_ids"].shape[1]
    if extra <= 0:
        return prompts
    tensors = dict(prompts.tensors)
    tensors["input_ids"] = torch.nn.functional.pad(prompts["input_ids"], (extra, 0), value=pad_token_id)
    tensors["attention_mask"] = torch.nn.functional.pad(prompts["attention_mask"], (extra, 0), value=0)
    return Batch(tensors, prompts.non_tensors, prompts.meta, prompts.group_size)


def sample_with_signal(
    config: FrameworkConfig,
    *,
    actor: ActorHandle,
    reward: RewardHandle,
    loader: PromptLoader,
    step: int,
    timer: StageTimer,
) -> tuple[BatchRef, dict[str, float]]:
    """The step's rollouts and scores with signal-free prompts dropped and the batch refilled from further prompts,
    for at most ``algorithm.max_sampling_rounds`` generation rounds, and the ``sampling/rounds`` and
    ``sampling/signal_fraction`` metrics. If the batch is still short after the last round it is filled with that
    round's signal-free groups (zero advantage), so its size never changes. The coordinator sees one score per row;
    rows are selected and merged where they are (``ActorWorker.select_rows`` / ``concat_rows``), and later calls
    rebalance them over the DP ranks."""
    group_size, wanted = config.rollout.n, config.data.batch_size
    selected, kept, first_round_signal = [], 0, 0.0
    for sampling_round in range(config.algorithm.max_sampling_rounds):
        # Further prompts come from beyond the run's own steps, so every round's prompts (and uids) are new.
        index = step + sampling_round * config.trainer.total_steps
        prompts = left_pad(loader.batch(index), width=config.data.max_prompt_length, pad_token_id=loader.pad_token_id)
        with timer("generate"):
            rollout = actor.generate_sequences(prompts)
        with timer("reward"):
            scores = reward.compute_rewards(rollout).result()
        signal = groups_with_signal(scores.fetch()["scores"], group_size)
        if sampling_round == 0:
            first_round_signal = float(signal.float().mean())
        keep = signal.clone()
        keep[signal.cumsum(0) > wanted - kept] = False
        if sampling_round == config.algorithm.max_sampling_rounds - 1:
            # Still short: fill up with this round's first signal-free groups, so the batch keeps its size.
            filler = (~signal).nonzero().squeeze(1)[: wanted - kept - int(keep.sum())]
            keep[filler] = True
        kept += int(keep.sum())
        rows = Batch({"keep": keep.repeat_interleave(group_size)}, group_size=group_size)
        selected.append(actor.select_rows(rollout, scores, keep=rows))
        if kept >= wanted:
            break
    metrics = {"sampling/rounds": sampling_round + 1.0, "sampling/signal_fraction": first_round_signal}
    rollout = selected[0].result() if len(selected) == 1 else actor.concat_rows(*selected).result()
    return rollout, metrics
