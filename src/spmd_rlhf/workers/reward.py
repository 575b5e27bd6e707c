"""Scoring roles: rule-based rewards (``spmd_rlhf.rewards``) or a reward / cost model with a score head.

Both give one score per response, ``scores`` ``[rows]`` (the cost role's output is named ``costs``). A rule sees the
decoded response text without special tokens; a model scores prompt + response as token ids, so a scoring model must
share the policy's tokenizer (reward models with their own tokenizer and chat template are not supported yet).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import AutoTokenizer

from ..config_schema import FrameworkConfig, ScoringRoleConfig
from ..data.batch import Batch
from ..rewards import RuleReward
from ..runtime import RoleContext, data_parallel
from .base import ModelWorker, RoleWorker


class RewardWorker(RoleWorker):
    def __init__(self, context: RoleContext, config: FrameworkConfig, *, role: str = "reward") -> None:
        role_config: ScoringRoleConfig = getattr(config, role)
        super().__init__(context, config, role_config)
        self.output_key = "scores" if role == "reward" else "costs"
        self.scorer: ModelWorker | None = None
        self.rule: RuleReward | None = None
        if role_config.kind == "model":
            self.scorer = ModelWorker(context, config, role_config, head="score", trainable=False)
        else:
            self.rule = RuleReward(role_config.rule)
            self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)

    @data_parallel
    def compute_rewards(self, batch: Batch) -> Batch:
        """One score per response; the batch meta carries their mean (and any extra numbers a rule returned)."""
        extras: dict[str, list[float]] = defaultdict(list)
        if self.scorer is not None:
            scores = self.scorer.forward_rows(batch, "compute_rewards", "scores", lambda outputs, micro: outputs.float())["scores"]
        else:
            texts = self.tokenizer.batch_decode(
                [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])],
                skip_special_tokens=True,
            )
            values = []
            for text, data_source, ground_truth, extra_info in zip(
                texts, batch["data_source"], batch["ground_truth"], batch["extra_info"]
            ):
                score, extra = self.rule.score(data_source, text, ground_truth, extra_info)
                values.append(score)
                for key, value in extra.items():
                    extras[key].append(value)
            scores = torch.tensor(values, dtype=torch.float32)
        keys = self.keys_over_dp(sorted(extras))
        sums = [scores.double().sum(), torch.tensor(float(len(scores)), dtype=torch.float64)]
        for key in keys:
            sums += [torch.tensor(sum(extras[key]), dtype=torch.float64), torch.tensor(float(len(extras[key])), dtype=torch.float64)]
        totals = self.sum_over_dp(torch.stack(sums)).tolist()
        metrics = {f"{self.context.name}/mean": totals[0] / totals[1]}
        for index, key in enumerate(keys):
            metrics[f"{self.context.name}/{key}/mean"] = totals[2 + 2 * index] / max(totals[3 + 2 * index], 1.0)
        return Batch({self.output_key: scores}, meta={"metrics": metrics}, group_size=batch.group_size)

    def keys_over_dp(self, keys: list[str]) -> list[str]:
        """The extra metric names returned on any DP rank (rules may return different ones for different rows)."""
        if self.dp_size == 1:
            return keys
        gathered: list[list[str] | None] = [None] * self.dp_size
        torch.distributed.all_gather_object(gathered, keys, group=self.dp_group)
        return sorted({key for rank_keys in gathered for key in rank_keys})
