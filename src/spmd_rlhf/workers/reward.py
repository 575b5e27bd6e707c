"""Scoring roles: rule-based rewards (``spmd_rlhf.rewards``), a remote reward service
(``spmd_rlhf.rewards.remote``), a reward / cost model with a score head, or a generative judge (``workers.judge``).

All give one score per response, ``scores`` ``[rows]`` (the cost role's output is named ``costs``). A rule sees the
decoded response text without special tokens; a remote service sees it too, with the prompt's text; a model scores
prompt + response as the policy's token ids when it shares the policy's tokenizer, and otherwise (a tokenizer of its
own with another vocabulary or chat template: ``data.retokenize``) the conversation rebuilt as text in its own chat
template and tokens; a judge reads the prompt and response as text in its own chat template and writes a verdict.

Every rank of a DP replica holds the same rows, so under a rule or a service the replica's TP x PP ranks each decode
and score a slice of them (in ``reward.num_workers`` processes each, or inline, or in requests to the service) and
gather the outcomes, and every rank ends with all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from spmd_rlhf.config import FrameworkConfig, ScoringRoleConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.data.retokenize import ChatRebuild, foreign_tokenizer, response_texts
from spmd_rlhf.rewards import RewardOutcome, RewardRow, RewardRunner, RewardScores, check_failure_fraction
from spmd_rlhf.rewards.remote import RemoteReward
from spmd_rlhf.runtime import RoleContext, data_parallel
from spmd_rlhf.training.sharded_model import ShardedModel
from spmd_rlhf.workers.base import RoleWorker
from spmd_rlhf.workers.judge import Judge, Judged


class RewardWorker(RoleWorker):
    """A scorer: a frozen ``ShardedModel`` with a score head (``kind: model``; with ``rebuild`` when the model has a
    tokenizer of its own), a ``RewardRunner`` of a rule, or a ``RemoteReward`` client of a service
    (``kind: remote``), or a generative ``Judge`` (``kind: generative``)."""

    def __init__(self, context: RoleContext, config: FrameworkConfig, *, role: str = "reward") -> None:
        role_config: ScoringRoleConfig = getattr(config, role)
        super().__init__(context, config, role_config)
        self.output_key = "scores" if role == "reward" else "costs"
        self.scorer: ShardedModel | None = None
        self.runner: RewardRunner | RemoteReward | None = None
        self.judge: Judge | None = None
        self.rebuild: ChatRebuild | None = None
        """The model's own chat template and tokens, when they are not the policy's (``data.retokenize``)."""
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        if role_config.kind == "model":
            self.scorer = ShardedModel(
                context, config, role_config, head="score", trainable=False, reducer=self.reducer
            )
            own_tokenizer = foreign_tokenizer(role_config, self.tokenizer)
            if own_tokenizer is not None:
                self.rebuild = ChatRebuild(self.tokenizer, own_tokenizer, role=role)
        elif role_config.kind == "generative":
            self.judge = Judge(context, config, role_config, policy_tokenizer=self.tokenizer)
        elif role_config.kind == "remote":
            self.runner = RemoteReward(
                role_config.url,
                batch_size=role_config.remote_batch_size,
                timeout_s=role_config.remote_timeout_s,
                retries=role_config.remote_retries,
                on_error=role_config.on_error,
                name=role,
            )
        else:
            self.runner = RewardRunner(
                role_config.rule,
                rule_kwargs=role_config.rule_kwargs,
                num_workers=role_config.num_workers,
                timeout_s=role_config.timeout_s,
                on_error=role_config.on_error,
                name=role,
            )

    @data_parallel
    def compute_rewards(self, batch: Batch) -> Batch:
        """One score per response (a model with a tokenizer of its own scores each row's conversation rebuilt in its
        chat template and tokens, from the row's ``raw_prompt`` and decoded response). The batch meta carries their
        mean, the mean of each extra number a rule returned and, for a rule or a service, the rows whose call failed
        (``<role>/errors``, ``/timeouts``, ``/non_finite``), over all DP ranks, and for a service the resent requests
        (``<role>/remote_retries``); for a judge, the verdicts that did not parse (``<role>/judge_unparsed``), the
        rows too long for its context (``<role>/judge_too_long``, scored with the fallback), the tokens it wrote
        (``<role>/judge_tokens``, over all DP ranks) and its seconds (``<role>/judge_seconds``, the slowest DP
        rank's). Under a rule, a service or a judge, more than ``<role>.max_failure_fraction`` of the
        step's calls (rows) failing is an error."""
        scored: RewardScores | None = None
        judged: Judged | None = None
        if self.judge is not None:
            judged = self.judge.judge(batch)
            scores = judged.scores
        elif self.scorer is not None:
            rows = batch if self.rebuild is None else self.rebuild(batch)
            scores = self.scorer.forward_rows(
                rows, "compute_rewards", "scores", lambda outputs, micro: outputs.float()
            )["scores"]
        else:
            scored = self.score_rows(batch)
            scores = torch.tensor(scored.scores, dtype=torch.float32)
        extras = scored.extras if scored else {}
        failures = scored.failures if scored else {}
        if judged is not None:
            failures = {"judge_unparsed": judged.unparsed, "judge_too_long": judged.too_long}
        # One object all-gather for every statistic: rules may return different extra numbers on different ranks.
        partial = {
            "scores": (float(scores.double().sum()), float(len(scores))),
            **{f"extra/{key}": (float(sum(values)), float(len(values))) for key, values in extras.items()},
            **{f"failed/{metric}": (float(count), 0.0) for metric, count in failures.items()},
        }
        remote = isinstance(self.runner, RemoteReward)
        if remote:
            partial["remote_retries"] = (float(scored.retries), 0.0)
        if judged is not None:
            partial["judge_tokens"] = (float(judged.generated_tokens), 0.0)
            partial["judge_seconds"] = (judged.seconds, 0.0)
        totals: dict[str, list[float]] = {}
        partials = self.reducer.gather_objects(partial)
        for rank_partial in partials:
            for key, (total, count) in rank_partial.items():
                sums = totals.setdefault(key, [0.0, 0.0])
                sums[0] += total
                sums[1] += count
        name = self.context.name
        metrics = {f"{name}/mean": totals["scores"][0] / totals["scores"][1]}
        for key in sorted(key for key in totals if key.startswith("extra/")):
            metrics[f"{name}/{key[len('extra/') :]}/mean"] = totals[key][0] / max(totals[key][1], 1.0)
        failed = {key[len("failed/") :]: int(total) for key, (total, _) in totals.items() if key.startswith("failed/")}
        metrics.update({f"{name}/{metric}": float(count) for metric, count in failed.items()})
        if remote:
            metrics[f"{name}/remote_retries"] = totals["remote_retries"][0]
        judge_fix = None
        if judged is not None:
            metrics[f"{name}/judge_tokens"] = totals["judge_tokens"][0]
            metrics[f"{name}/judge_seconds"] = max(rank_partial["judge_seconds"][0] for rank_partial in partials)
            judge_fix = (
                f"the judge's verdicts did not match {name}.judge_score_pattern within {name}.judge_score_range "
                f"(check them against {name}.judge_template), or its prompts and {name}.judge_max_new_tokens "
                f"outgrew its context (shorten data.max_prompt_length, rollout.max_new_tokens or the template)"
            )
        if self.scorer is None:  # every DP rank holds the same totals, so every rank raises or none does
            check_failure_fraction(
                failed,
                int(totals["scores"][1]),
                max_failure_fraction=self.role_config.max_failure_fraction,
                name=name,
                fix=judge_fix or (self.runner.fix if remote else None),
            )
        return Batch({self.output_key: scores}, meta={"metrics": metrics}, group_size=batch.group_size)

    def score_rows(self, batch: Batch) -> RewardScores:
        """The rule's or the service's scores of every row: this rank decodes and scores its slice of the replica's
        rows, the replica's ranks gather the outcomes, then each summarizes them (under ``on_error=abort``, all
        raise). A service is also sent each prompt's text (decoded with its special tokens, without padding)."""
        dims = self.context.dims
        position, replica_size = self.pp_rank * dims.tp + self.tp_rank, dims.pp * dims.tp
        start, stop = len(batch) * position // replica_size, len(batch) * (position + 1) // replica_size
        responses, masks = batch["responses"][start:stop], batch["response_mask"][start:stop]
        texts = response_texts(self.tokenizer, responses, masks)
        sources, truths, extra_infos = (batch[key][start:stop] for key in ("data_source", "ground_truth", "extra_info"))
        prompts = [""] * len(texts)
        if isinstance(self.runner, RemoteReward):  # rules are not given the prompt: decode it only for a service
            prompt_ids, prompt_masks = batch["prompts"][start:stop], batch["attention_mask"][start:stop]
            prompt_masks = prompt_masks[:, : prompt_ids.shape[1]].bool()
            prompts = self.tokenizer.batch_decode([row[mask].tolist() for row, mask in zip(prompt_ids, prompt_masks)])
        rows = [RewardRow(*fields) for fields in zip(sources, texts, truths, extra_infos, prompts)]
        return self.runner.summarize(self.gather_over_replica(position, self.runner.score(rows)))

    def gather_over_replica(self, position: int, outcomes: list[RewardOutcome]) -> list[RewardOutcome]:
        """The outcomes of all the replica's ranks in row order, from each rank's ``(position, outcomes)``: gathered
        over the TP group, then the PP group (the mesh's own groups; their group ranks follow global rank order,
        which need not be position order, hence the positions)."""
        parts = [(position, outcomes)]
        for dim in ("tp", "pp"):
            size = getattr(self.context.dims, dim)
            if size > 1:
                gathered: list[list[tuple[int, list[RewardOutcome]]] | None] = [None] * size
                dist.all_gather_object(gathered, parts, group=self.mesh[dim].get_group())
                parts = [part for rank_parts in gathered for part in rank_parts]
        return [outcome for _, part in sorted(parts, key=lambda part: part[0]) for outcome in part]
