"""The actor: the policy being trained. It generates the rollouts with the built-in engine, computes their log-probs,
estimates advantages where its DP shards already are, and takes PPO steps.

Generation runs in the 3D-HybridEngine's generation layout (``rollout.tp`` dividing ``actor.tp``, every rank holding
all layers of its generation shard), built from the training shards just before the rollouts and dropped right after.
The engine runs the same model code as training, so rollout log-probs equal ``compute_log_probs`` on the same weights.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoTokenizer

from ..algos import (
    aggregate,
    apply_kl_penalty,
    broadcast_to_tokens,
    entropy_bonus,
    gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    policy_loss,
    scores_to_token_rewards,
    whiten,
)
from ..config_schema import FrameworkConfig
from ..data.batch import Batch
from ..engine import LLMEngine, SamplingParams
from ..hybrid import GenerationLayout, HybridEngine
from ..runtime import ParallelDims, RoleContext, data_parallel
from .base import union_all
from .training import TrainedWorker

ADVANTAGE_ESTIMATORS = ("gae", "grpo")

_SEED_STRIDE = 1_000_003


def sample_seed(run_seed: int, uid: int, sample: int, samples_per_prompt: int) -> int:
    """The sampling seed of sample ``sample`` of the prompt with run-unique ``uid``: the same whatever the DP split."""
    return (run_seed * _SEED_STRIDE + uid * samples_per_prompt + sample) % (2**63)


def old_log_probs(batch: Batch) -> torch.Tensor:
    """π_old of the PPO ratio: recomputed ``old_log_probs`` when present, else the engine's ``rollout_log_probs``."""
    return batch["old_log_probs"] if "old_log_probs" in batch.tensors else batch["rollout_log_probs"]


class ActorWorker(TrainedWorker):
    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.actor, head="lm")
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.hybrid = HybridEngine(
            self.model, layout=GenerationLayout(context.dims, context.ranks, config.rollout.tp), rank=context.rank,
            groups=context.groups, pp_group=self.pp_group, stage_ranks=self.stage_ranks, device=self.device,
            attention_backend=config.model.attention,
        )

    @staticmethod
    def process_groups(dims: ParallelDims, ranks: tuple[int, ...], config: FrameworkConfig) -> dict[str, list[list[int]]]:
        """The 3D-HybridEngine's groups, created by the runtime on every rank when the actor is spawned."""
        return GenerationLayout(dims, ranks, config.rollout.tp).process_groups()

    @property
    def temperature(self) -> float:
        """Log-probs are those of the sampling distribution, softmax(logits / T); greedy counts as T = 1."""
        return self.config.rollout.temperature or 1.0

    # ---- generation --------------------------------------------------------------------------------------------

    def _engine(self, model) -> LLMEngine:
        rollout = self.config.rollout
        sizing = {}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            sizing["kv_cache_bytes"] = int(max(0, rollout.memory_fraction * total - (total - free)))
        # Elsewhere the engine sizes its cache to run every request to full length (host memory is plentiful
        # relative to the caches of CPU-sized models), so nothing is ever preempted.
        return LLMEngine(
            model,
            eos_token_id=self.tokenizer.eos_token_id,
            block_size=rollout.kv_block_size,
            max_num_seqs=rollout.max_num_seqs,
            seed=self.config.trainer.seed,
            **sizing,
        )

    @data_parallel
    def generate_sequences(self, prompts: Batch, *, greedy: bool = False) -> Batch:
        """``rollout.n`` responses per prompt (rows of one prompt consecutive, ``group_size = n``) in the rollout layout,
        responses padded to ``rollout.max_new_tokens`` so every DP shard has the same shape. ``greedy`` (validation):
        one greedy response per prompt."""
        rollout = self.config.rollout
        n, response_length = (1 if greedy else rollout.n), rollout.max_new_tokens
        temperature = 0.0 if greedy else rollout.temperature
        # This rank's generation replica answers a share of the DP group's prompts; the rows are gathered back below.
        mine = prompts.select(self.hybrid.replica_rows(len(prompts)))
        prompt_tokens = [ids[mask.bool()].tolist() for ids, mask in zip(mine["input_ids"], mine["attention_mask"])]
        requests, params = [], []
        for tokens, uid in zip(prompt_tokens, mine["uid"].tolist()):
            for sample in range(n):
                requests.append(tokens)
                params.append(
                    SamplingParams(
                        temperature=temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                        max_new_tokens=response_length, seed=sample_seed(self.config.trainer.seed, uid, sample, n),
                    )
                )
        model = self.hybrid.generation_model(getattr(torch, self.config.model.dtype))
        engine = self._engine(model)
        outputs = engine.generate(requests, params)
        preemptions = engine.num_preemptions
        del engine, model  # the KV cache and the generation shard go before training resumes

        rows = len(requests)
        responses = torch.full((rows, response_length), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((rows, response_length), dtype=torch.long)
        rollout_log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
        for row, output in enumerate(outputs):
            length = len(output.generated_token_ids)
            responses[row, :length] = torch.tensor(output.generated_token_ids)
            response_mask[row, :length] = 1
            rollout_log_probs[row, :length] = torch.tensor(output.log_probs)
        gathered = self.hybrid.gather_rows(
            {"responses": responses, "response_mask": response_mask, "rollout_log_probs": rollout_log_probs}
        )
        responses, response_mask, rollout_log_probs = gathered["responses"], gathered["response_mask"], gathered["rollout_log_probs"]
        # Each replica counted its own preemptions; the other DP groups' replicas add theirs below.
        preemptions = self.hybrid.sum_over_replicas(preemptions)
        rows = len(responses)
        repeated = prompts.repeat(n)
        attention_mask = torch.cat([repeated["attention_mask"], response_mask], dim=1)
        lengths = response_mask.sum(dim=1).double()
        prompt_tokens = repeated["attention_mask"].sum().double()
        clipped = (response_mask[:, -1] == 1).double().sum()
        totals = self.sum_over_dp(torch.stack([lengths.sum(), torch.tensor(float(rows), dtype=torch.float64), clipped, prompt_tokens]))
        extremes = self.max_over_dp(torch.stack([lengths.max(), -lengths.min()]))
        metrics = {
            "response_length/mean": float(totals[0] / totals[1]),
            "response_length/max": float(extremes[0]),
            "response_length/min": float(-extremes[1]),
            "response_length/clip_ratio": float(totals[2] / totals[1]),
            "rollout/generated_tokens": float(totals[0]),
            "rollout/prompt_tokens": float(totals[3]),
            "rollout/preemptions": float(self.sum_over_dp(torch.tensor(float(preemptions)))),
        }
        return Batch(
            {
                "prompts": repeated["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": torch.cat([repeated["input_ids"], responses], dim=1),
                "attention_mask": attention_mask,
                "rollout_log_probs": rollout_log_probs,
                "uid": repeated["uid"],
            },
            dict(repeated.non_tensors),
            {"metrics": metrics},
            group_size=n,
        )

    # ---- log-probs ---------------------------------------------------------------------------------------------

    @data_parallel
    def compute_log_probs(self, batch: Batch) -> Batch:
        """``old_log_probs`` ``[rows, R]`` of the responses under the current policy (at the rollout temperature)."""
        return self.forward_rows(
            batch, "compute_log_probs", "old_log_probs",
            lambda logits, micro: self.response_log_probs(logits, micro, self.temperature)[0],
        )

    # ---- advantages --------------------------------------------------------------------------------------------

    @data_parallel
    def compute_advantages(self, *parts: Batch, estimator: str, kl_coef: float | None = None) -> Batch:
        """``advantages`` (and ``returns`` for GAE) from the rollout and its scores, log-probs and values.

        Runs where the rows already are, so per-token tensors never pass through the coordinator. ``estimator``:
        ``gae`` (needs ``values``) or ``grpo`` (group baseline over the n samples of each prompt, which a DP shard
        always holds whole). With ``algorithm.kl_penalty=reward`` the KL to the reference is subtracted from the
        per-token rewards first (weight ``kl_coef``, else ``algorithm.kl_coef``). Whitening statistics are those of the
        whole batch over all DP ranks.
        """
        if estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {estimator!r} is unknown; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
        algorithm = self.config.algorithm
        data = union_all(parts)
        mask = data["response_mask"]
        scores = data["scores"].float()
        token_rewards = scores_to_token_rewards(scores, mask)
        tensors: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        if "ref_log_probs" in data.tensors:
            kl = kl_estimate(old_log_probs(data), data["ref_log_probs"], algorithm.kl_estimator)
            per_sequence_kl = (kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            totals = self.sum_over_dp(torch.stack([per_sequence_kl.sum().double(), torch.tensor(float(len(data)), dtype=torch.float64)]))
            metrics["kl/mean"] = float(totals[0] / totals[1])
            if algorithm.kl_penalty == "reward":
                token_rewards = apply_kl_penalty(token_rewards, kl, algorithm.kl_coef if kl_coef is None else kl_coef, mask)
        if estimator == "gae":
            advantages, returns = gae(token_rewards, data["values"].float(), mask, gamma=algorithm.gamma, lam=algorithm.lam)
            tensors["returns"] = returns
            if algorithm.normalize_advantages:
                advantages = whiten(advantages, mask, sum_over_ranks=self.sum_over_dp)
        else:
            sequence_rewards = (token_rewards * mask).sum(dim=1)
            advantages = broadcast_to_tokens(
                group_advantages(sequence_rewards, data.group_size, normalize_std=algorithm.normalize_advantages), mask
            )
        tensors["advantages"] = advantages
        metrics["advantages/mean"] = float(self.masked_mean_over_dp(advantages, mask))
        if "old_log_probs" in data.tensors:
            # Engine and trainer run the same model code: this stays at rounding level (1e-6 in float32).
            difference = ((data["old_log_probs"] - data["rollout_log_probs"]).abs() * mask).max()
            metrics["rollout/log_prob_diff_max"] = float(self.max_over_dp(difference))
        return Batch(tensors, meta={"metrics": metrics}, group_size=data.group_size)

    # ---- training ----------------------------------------------------------------------------------------------

    def _policy_loss(self, logits: torch.Tensor, micro: Batch, denominators, *, kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
        algorithm = self.config.algorithm
        aggregation = algorithm.loss_aggregation
        mask = micro["response_mask"].to(self.device)
        log_probs, entropy = self.response_log_probs(logits, micro, self.temperature, with_entropy=True)
        loss, metrics = policy_loss(
            log_probs, old_log_probs(micro).to(self.device), micro["advantages"].to(self.device), mask,
            clip_low=algorithm.clip_ratio_low, clip_high=algorithm.clip_ratio_high,
            aggregation=aggregation, denominators=denominators,
        )
        if algorithm.entropy_coef:
            loss = loss - algorithm.entropy_coef * entropy_bonus(entropy, mask, aggregation=aggregation, denominators=denominators)
        if algorithm.kl_penalty == "loss":
            kl = kl_estimate(log_probs, micro["ref_log_probs"].to(self.device), algorithm.kl_estimator)
            loss = loss + kl_coef * aggregate(kl, mask, aggregation, denominators)
            metrics["actor/kl_loss"] = float(masked_mean(kl.detach(), mask))
        metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
        # FSDP sums gradients over DP ranks; the loss is this micro-batch's share of the global mini-batch loss.
        return loss, metrics

    @data_parallel
    def update_actor(self, *parts: Batch, kl_coef: float | None = None) -> dict[str, float]:
        """PPO epochs over the rows of ``parts`` (together: the rollout, ``advantages``, ``old_log_probs`` if
        recomputed, and ``ref_log_probs`` when the KL is a loss term); returns this rank's mean metrics.
        ``kl_coef``: the KL loss weight of this step (an adaptive controller's), else ``algorithm.kl_coef``."""
        coef = self.config.algorithm.kl_coef if kl_coef is None else kl_coef
        loss = functools.partial(self._policy_loss, kl_coef=coef)
        return self.trainer.update(union_all(parts), loss, method="update_actor", prefix="actor")
