"""The actor: the policy being trained. It generates the rollouts with the built-in engine, computes their log-probs,
estimates advantages where its DP shards already are, and takes PPO steps.

Generation runs in the 3D-HybridEngine's generation layout (``rollout.tp`` dividing ``actor.tp``, every rank holding
all layers of its generation shard), written from the training shards just before the rollouts: into the same model
and engine every step with ``rollout.keep_engine`` (so CUDA graphs are captured once per run), else into a fresh model
dropped right after.
The engine runs the same model code as training, so rollout log-probs equal ``compute_log_probs`` on the same weights.
"""

from __future__ import annotations

import functools

import torch

from spmd_rlhf.algos import (
    Correction,
    Denominators,
    aggregate,
    cispo_loss,
    combine_advantages,
    correct,
    correction_metrics,
    entropy_bonus,
    gmpo_loss,
    kl_estimate,
    masked_mean,
    policy_loss,
    sapo_loss,
)
from spmd_rlhf.algos.off_policy import SUMMED
from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.hybrid import GenerationLayout, HybridEngine
from spmd_rlhf.hybrid.weight_sync import BackgroundSender, send_weights, snapshot, sync_metrics, trainer_parameters
from spmd_rlhf.models.lora import merged_parameters
from spmd_rlhf.runtime import ParallelDims, RoleContext, data_parallel, one_to_all
from spmd_rlhf.training.packing import MicroBatch
from spmd_rlhf.training.router_replay import ROUTED_EXPERTS
from spmd_rlhf.training.sharded_model import ShardedModel
from spmd_rlhf.training.trainer import LOSS_MASK, Trainer
from spmd_rlhf.workers.advantages import behaviour_log_probs, old_log_probs, rollout_advantages
from spmd_rlhf.workers.base import TrainedRoleWorker, union_all
from spmd_rlhf.workers.generation import Generator
from spmd_rlhf.workers.rollout import sync_sides, weight_sync_groups


class ActorWorker(TrainedRoleWorker):
    """The policy: a ``ShardedModel`` with an LM head, its ``Trainer``, and the ``HybridEngine`` that generates
    with the same weights in the generation layout."""

    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.actor)
        self.model = ShardedModel(
            context,
            config,
            config.actor,
            head="lm",
            trainable=True,
            reducer=self.reducer,
            router_replay=config.algorithm.router_replay,
        )
        self.trainer = Trainer(
            self.model,
            self.reducer,
            config.actor,
            total_steps=config.trainer.total_steps,
            max_response_length=config.rollout.response_length,
            max_skipped_steps=config.trainer.max_skipped_steps,
        )
        self.generator = Generator(
            config,
            role=context.name,
            model_path=self.model.model_path,
            vocab_size=self.model.module.args.vocab_size,
            device=self.device,
            reducer=self.reducer,
        )
        self.hybrid = HybridEngine(
            self.model.module,
            layout=GenerationLayout(context.dims, context.ranks, config.rollout.tp),
            rank=context.rank,
            groups=context.groups,
            pp_group=self.model.pp_group,
            stage_ranks=self.model.stage_ranks,
            device=self.device,
            attention_backend=config.model.attention,
            adapters=self.model.adapters,
            keep_generation=config.rollout.keep_engine,
        )
        self.background_sender = (
            BackgroundSender(self.device, timeout_s=config.trainer.collective_timeout_s)
            if config.rollout.background_sync
            else None
        )

    @staticmethod
    def process_groups(
        dims: ParallelDims, ranks: tuple[int, ...], config: FrameworkConfig
    ) -> dict[str, list[list[int]]]:
        """The 3D-HybridEngine's groups, and with a rollout role the ``weight_sync`` group (and with
        ``rollout.background_sync`` the ``weight_snapshot`` group), created by the runtime on every rank when the
        actor is spawned."""
        groups = {**GenerationLayout(dims, ranks, config.rollout.tp).process_groups(), **weight_sync_groups(config)}
        if config.rollout.background_sync:
            groups["weight_snapshot"] = [list(ranks)]  # the background sender's own group over the actor's ranks
        return groups

    @property
    def temperature(self) -> float:
        """Log-probs are those of the sampling distribution, softmax(logits / T); greedy counts as T = 1."""
        return self.config.rollout.temperature or 1.0

    # ---- generation --------------------------------------------------------------------------------------------

    @data_parallel
    def generate_sequences(self, prompts: Batch, *, greedy: bool = False, samples: int | None = None) -> Batch:
        """``Generator.generate`` in the HybridEngine's generation layout, written from the training shards for
        this call (kept for the next with ``rollout.keep_engine``, else dropped before this returns; ``rollout.n``
        responses per prompt, ``samples`` if given; ``greedy``: one greedy response per prompt)."""
        model = self.hybrid.generation_model(getattr(torch, self.config.model.dtype))
        batch = self.generator.generate(prompts, model, self.hybrid, greedy=greedy, samples=samples)
        del model  # without rollout.keep_engine, the generation shard goes before training resumes
        return batch

    @one_to_all
    def send_weights(self, version: int) -> dict[str, float]:
        """Send the current weights, as policy ``version``, to the rollout role (its ``receive_weights`` runs
        beside this, ``hybrid.weight_sync``), a LoRA actor's adapters merged into its weights; every actor rank takes
        part. With ``rollout.background_sync`` this returns once the shards are copied, and a thread sends the copy
        while the actor goes on."""
        params = trainer_parameters(self.model.module)
        if self.model.adapters is not None:
            # The rollout generates without adapters: it gets the base weights with the adapters merged in.
            params = merged_parameters(params, self.model.adapters)
        dtype = getattr(torch, self.config.model.dtype)
        options = dict(
            sides=sync_sides(self.config, self.context.groups),
            rank=self.context.rank,
            dtype=dtype,
            bucket_bytes=int(self.config.rollout.sync_bucket_mb * 2**20),
            device=self.device,
        )
        if self.background_sender is None:
            return send_weights(params, trainer_group=self.context.groups["role"], version=version, **options)
        self.background_sender.start(
            snapshot(params, dtype), trainer_group=self.context.groups["weight_snapshot"], version=version, **options
        )
        return sync_metrics(params, dtype=dtype, bucket_bytes=options["bucket_bytes"])

    # ---- selecting and merging rows in place (dynamic sampling) --------------------------------------------------

    @data_parallel
    def select_rows(self, *parts: Batch, keep: Batch) -> Batch:
        """The rows of ``parts`` (together) where ``keep["keep"]`` is true, kept where they are; DP shards may end
        up uneven, and the next data-parallel call rebalances them. Metrics in the parts' meta are carried along."""
        data = union_all(parts)
        metrics = {key: value for part in parts for key, value in part.meta.get("metrics", {}).items()}
        selected = data.select(keep["keep"].nonzero().squeeze(1), group_size=data.group_size)
        return Batch(selected.tensors, selected.non_tensors, {"metrics": metrics}, data.group_size)

    @data_parallel
    def concat_rows(self, *batches: Batch) -> Batch:
        """The rows of ``batches`` one after another (each DP rank concatenates its shares); meta of the first."""
        return Batch.concat(batches)

    # ---- log-probs ---------------------------------------------------------------------------------------------

    @data_parallel
    def compute_log_probs(self, batch: Batch) -> Batch:
        """``old_log_probs`` ``[rows, R]`` of the responses under the current policy (at the rollout temperature;
        0 past the response, like the engine's ``rollout_log_probs``)."""
        return self._response_log_probs(batch, "compute_log_probs", "old_log_probs")

    @data_parallel
    def compute_ref_log_probs(self, batch: Batch) -> Batch:
        """``ref_log_probs`` ``[rows, R]`` under the reference policy when that is this actor's base
        (``dataflow.reference_is_actor_base``): the same forward pass with the LoRA adapters switched off, so the
        reference needs no second copy of the model."""
        if self.model.adapters is None:
            raise ValueError(
                "actor.compute_ref_log_probs needs LoRA adapters (actor.lora.rank >= 1); without them the reference is "
                "a role of its own (reference.enabled=true)"
            )
        with self.model.adapters.disabled():
            return self._response_log_probs(batch, "compute_ref_log_probs", "ref_log_probs")

    def _response_log_probs(self, batch: Batch, method: str, key: str) -> Batch:
        """With ``algorithm.router_replay=recompute`` the old-policy pass also records each token's experts
        (``routed_experts``), which the updates then replay."""

        def log_probs(logits: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
            return self.model.response_log_probs(logits, micro, self.temperature)[0]

        if method != "compute_log_probs" or self.config.algorithm.router_replay != "recompute":
            return self.model.forward_rows(batch, method, key, log_probs)
        replay = self.model.router_replay
        with replay.recording() as seen:
            return self.model.forward_rows(
                batch,
                method,
                key,
                lambda logits, micro: {key: log_probs(logits, micro), ROUTED_EXPERTS: replay.routes_of(seen, micro)},
            )

    # ---- advantages --------------------------------------------------------------------------------------------

    @data_parallel
    def compute_advantages(
        self,
        *parts: Batch,
        estimator: str,
        kl_coef: float | None = None,
        source: str = "reward",
        baseline: Batch | None = None,
    ) -> Batch:
        """``advantages`` (and ``returns`` for GAE) from the rollout and its scores, log-probs and values; with
        ``source="cost"``, ``cost_advantages`` / ``cost_returns`` from ``costs`` and ``cost_values`` (Safe-RLHF).

        Runs where the rows already are, so per-token tensors never pass through the coordinator. ``estimator``: one
        of ``workers.advantages.ADVANTAGE_ESTIMATORS`` (the table there); group estimators rely on a DP shard always
        holding a prompt's n samples whole. ``baseline`` (remax): the scores of one greedy response per prompt.
        With ``algorithm.kl_penalty=reward`` the KL to the reference (weight ``kl_coef``, else ``algorithm.kl_coef``)
        is subtracted from the per-token rewards first. Whitening statistics are those of the whole batch.
        """
        data = union_all(parts)
        tensors, metrics = rollout_advantages(
            data,
            estimator=estimator,
            algorithm=self.config.algorithm,
            reducer=self.reducer,
            source=source,
            kl_coef=self.config.algorithm.kl_coef if kl_coef is None else kl_coef,
            max_response_length=self.config.rollout.response_length,
            baseline_scores=None if baseline is None else baseline["scores"],
        )
        if source == "reward" and "old_log_probs" in data.tensors:
            # Engine and trainer run the same model code: this stays at rounding level (1e-6 in float32).
            difference = ((data["old_log_probs"] - data["rollout_log_probs"]).abs() * data["response_mask"]).max()
            metrics["rollout/log_prob_diff_max"] = float(self.reducer.max(difference))
        return Batch(tensors, meta={"metrics": metrics}, group_size=data.group_size)

    # ---- training ----------------------------------------------------------------------------------------------

    def _policy_loss(
        self,
        logits: torch.Tensor,
        micro: MicroBatch,
        rows: Batch,
        denominators: Denominators,
        *,
        kl_coef: float,
        cost_multiplier: float | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The ``Trainer``'s loss function: ``rows`` are the micro-batch's rows on the model's device."""
        algorithm = self.config.algorithm
        aggregation = algorithm.loss_aggregation
        # The response tokens the rollout correction kept (all of them without rejection).
        mask = rows[LOSS_MASK] if LOSS_MASK in rows.tensors else rows["response_mask"]
        log_probs, entropy = self.model.response_log_probs(logits, micro, self.temperature, with_entropy=True)
        advantages = rows["advantages"]
        if cost_multiplier is not None:
            advantages = combine_advantages(advantages, rows["cost_advantages"], cost_multiplier)
        loss, metrics = self._surrogate(log_probs, old_log_probs(rows), advantages, mask, rows, denominators)
        if algorithm.entropy_coef:
            loss = loss - algorithm.entropy_coef * entropy_bonus(
                entropy, mask, aggregation=aggregation, denominators=denominators
            )
        if algorithm.kl_penalty == "loss":
            kl = kl_estimate(log_probs, rows["ref_log_probs"], algorithm.kl_estimator)
            loss = loss + kl_coef * aggregate(kl, mask, aggregation, denominators)
            metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask)
        # FSDP sums gradients over DP ranks; the loss is this micro-batch's share of the global mini-batch loss.
        return loss, metrics

    def _surrogate(
        self,
        log_probs: torch.Tensor,
        proximal_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        rows: Batch,
        denominators: Denominators,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``algorithm.policy_loss`` of the micro-batch, each token weighted by the rollout correction's weights."""
        algorithm = self.config.algorithm
        weights = rows["correction_weights"] if "correction_weights" in rows.tensors else None
        clip = {"clip_low": algorithm.clip_ratio_low, "clip_high": algorithm.clip_ratio_high}
        common = {"denominators": denominators, "token_weights": weights}
        arguments = (log_probs, proximal_log_probs, advantages, mask)
        aggregation = algorithm.loss_aggregation
        if algorithm.policy_loss == "cispo":
            return cispo_loss(*arguments, **clip, aggregation=aggregation, **common)
        if algorithm.policy_loss == "gmpo":  # its own mean over responses, whatever loss_aggregation says
            return gmpo_loss(*arguments, **clip, **common)
        if algorithm.policy_loss == "sapo":
            taus = {"tau_positive": algorithm.sapo_tau_positive, "tau_negative": algorithm.sapo_tau_negative}
            return sapo_loss(*arguments, **taus, aggregation=aggregation, **common)
        level = "sequence" if algorithm.policy_loss == "gspo" else "token"
        return policy_loss(*arguments, **clip, aggregation=aggregation, ratio_level=level, **common)

    def _corrected(self, data: Batch) -> tuple[Batch, dict[str, float]]:
        """``data`` with the rollout correction's ``loss_mask`` (and ``correction_weights`` with importance weights)
        when its log-probs were recomputed, and the correction's metrics over the DP group; else ``data`` as it is.
        Computed once per update: both log-probs are constants of it."""
        if "old_log_probs" not in data.tensors or "rollout_log_probs" not in data.tensors:
            return data, {}  # pi_old is the behaviour policy's own log-probs: nothing to correct
        settings = self.config.algorithm.correction
        correction = Correction(
            is_level=settings.is_level,
            is_threshold=settings.is_threshold,
            rs_level=settings.rs_level,
            rs_upper=settings.rs_upper,
            rs_lower=settings.rs_lower,
            veto_threshold=settings.veto_threshold,
        )
        mask = data["response_mask"]
        corrected = correct(data["old_log_probs"], behaviour_log_probs(data), mask, correction)
        local = torch.stack([corrected.metrics[key] for key in (*SUMMED, "weight_max", "weight_min")]).tolist()
        sums, (largest, negated_smallest) = self.reducer.totals(local[: len(SUMMED)], [local[-2], -local[-1]])
        if not sums[0]:  # no response token on any rank
            return data, {}
        added = {LOSS_MASK: corrected.loss_mask.to(mask.dtype)}
        if correction.is_level is not None:
            added["correction_weights"] = corrected.weights.to(data["old_log_probs"].dtype)
        metrics = correction_metrics(dict(zip(SUMMED, sums)), -negated_smallest, largest)
        return data.union(Batch(added)), metrics

    def _staleness_metrics(self, data: Batch, policy_version: int) -> dict[str, float]:
        """How many updates behind the policy that trains them the response tokens are, over the whole batch, and the
        a token beyond ``algorithm.max_staleness`` is a scheduling bug and stops the run."""
        algorithm = self.config.algorithm
        mask = data["response_mask"].bool()
        staleness = (policy_version - data["token_versions"])[mask].double()
        (total, count), (largest,) = self.reducer.totals(
            [float(staleness.sum()), float(staleness.numel())], [float(staleness.max()) if staleness.numel() else 0.0]
        )
        if largest > algorithm.max_staleness:
            raise RuntimeError(
                f"update_actor at policy version {policy_version} got tokens {largest:g} versions old, beyond "
                f"algorithm.max_staleness={algorithm.max_staleness}: the coordinator's rollout schedule is wrong"
            )
        return {"off_policy/staleness_max": largest, "off_policy/staleness_mean": total / max(count, 1.0)}

    @data_parallel
    def update_actor(
        self,
        *parts: Batch,
        kl_coef: float | None = None,
        cost_multiplier: float | None = None,
        policy_version: int | None = None,
    ) -> dict[str, float]:
        """PPO epochs over the rows of ``parts`` (together: the rollout, ``advantages``, ``old_log_probs`` if
        recomputed, and ``ref_log_probs`` when the KL is a loss term); returns this rank's mean metrics.
        ``kl_coef``: the KL loss weight of this step (an adaptive controller's), else ``algorithm.kl_coef``.
        ``cost_multiplier`` (Safe-RLHF's λ): the policy follows (A_reward − λ·A_cost) / (1 + λ), with
        ``cost_advantages`` among ``parts``. ``policy_version`` (with a rollout role: the updates taken so far):
        the rows' ``token_versions`` give their staleness. With recomputed ``old_log_probs`` the rollout correction
        (``algorithm.correction``) weights and rejects tokens by pi_old / pi_behaviour (``algos.off_policy``)."""
        coef = self.config.algorithm.kl_coef if kl_coef is None else kl_coef
        loss = functools.partial(self._policy_loss, kl_coef=coef, cost_multiplier=cost_multiplier)
        data = union_all(parts)
        staleness = {} if policy_version is None else self._staleness_metrics(data, policy_version)
        data, correction = self._corrected(data)
        return {**self.trainer.update(data, loss, method="update_actor", prefix="actor"), **staleness, **correction}
