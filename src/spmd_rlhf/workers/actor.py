"""The actor: the policy being trained. It generates the rollouts with the built-in engine, computes their log-probs,
estimates advantages where its DP shards already are, and takes PPO steps.

Generation runs in the 3D-HybridEngine's generation layout (``rollout.tp`` dividing ``actor.tp``, every rank holding
all layers of its generation shard), built from the training shards just before the rollouts and dropped right after.
The engine runs the same model code as training, so rollout log-probs equal ``compute_log_probs`` on the same weights.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..algos import aggregate, combine_advantages, entropy_bonus, kl_estimate, masked_mean, policy_loss
from ..config_schema import FrameworkConfig
from ..data.batch import Batch
from ..engine import LLMEngine, SamplingParams
from ..envs import ChatDelta, environment_factory
from ..envs.rollout import response_tensors, run_multi_turn
from ..hybrid import GenerationLayout, HybridEngine
from ..runtime import ParallelDims, RoleContext, data_parallel, one_to_all
from ..runtime.device import check_thread
from .advantages import old_log_probs, rollout_advantages
from .base import RoleWorker, union_all
from .packing import MicroBatch
from .sharded_model import ShardedModel
from .training import Trainer

_SEED_STRIDE = 1_000_003


def stop_token_ids(configured: list[int], model_path: str, vocab_size: int) -> frozenset[int]:
    """``rollout.stop_token_ids`` and the eos_token_id(s) of the model's generation_config.json, if it has one: the
    ids besides the tokenizer's EOS that end a response. An id past the vocabulary is a config error."""
    ids = set(configured)
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update([] if eos is None else [eos] if isinstance(eos, int) else eos)
    outside = sorted(token for token in ids if token >= vocab_size)
    if outside:
        raise ValueError(
            f"stop token ids {outside} (rollout.stop_token_ids, or eos_token_id in {generation_config}) are outside "
            f"the model's vocabulary of {vocab_size}; remove them"
        )
    return frozenset(ids)


def sample_seed(run_seed: int, uid: int, sample: int, samples_per_prompt: int) -> int:
    """The sampling seed of sample ``sample`` of the prompt with run-unique ``uid``: the same whatever the DP split."""
    return (run_seed * _SEED_STRIDE + uid * samples_per_prompt + sample) % (2**63)


class ActorWorker(RoleWorker):
    """The policy: a ``ShardedModel`` with an LM head, its ``Trainer``, and the ``HybridEngine`` that generates
    with the same weights in the generation layout."""

    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.actor)
        self.model = ShardedModel(context, config, config.actor, head="lm", trainable=True, reducer=self.reducer)
        self.trainer = Trainer(
            self.model, self.reducer, config.actor, total_steps=config.trainer.total_steps,
            max_response_length=config.rollout.response_length, max_skipped_steps=config.trainer.max_skipped_steps,
        )
        tokenizer_path = self.model.tokenizer_path
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        vocab_size = self.model.module.args.vocab_size
        if len(self.tokenizer) > vocab_size:
            # Prompt ids past the embedding would fail mid-run; responses would be decoded into the wrong text.
            raise ValueError(
                f"the tokenizer at {tokenizer_path} has {len(self.tokenizer)} tokens but the actor's model at "
                f"{config.actor.model_path or config.model.path} has vocab_size={vocab_size}; point "
                f"model.tokenizer_path at the model's own tokenizer (null: model.path)"
            )
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.stop_token_ids = stop_token_ids(config.rollout.stop_token_ids, self.model.model_path, vocab_size)
        self.environment = self.chat_delta = None
        if config.rollout.environment is not None:
            self.environment = environment_factory(config.rollout.environment)
            self.chat_delta = ChatDelta(self.tokenizer)
            # A turn must be able to end where the template ends an assistant turn, or no observation can follow.
            self.stop_token_ids |= {self.chat_delta.turn_end_id}
        self.hybrid = HybridEngine(
            self.model.module, layout=GenerationLayout(context.dims, context.ranks, config.rollout.tp), rank=context.rank,
            groups=context.groups, pp_group=self.model.pp_group, stage_ranks=self.model.stage_ranks, device=self.device,
            attention_backend=config.model.attention, adapters=self.model.adapters,
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
        if rollout.kv_cache_blocks:
            sizing["num_blocks"] = rollout.kv_cache_blocks
        elif self.device.type == "cuda":
            # Each rank measures its own free memory; the engine takes the minimum over the generation TP group, so
            # the replica's ranks run one schedule.
            free, total = torch.cuda.mem_get_info(self.device)
            sizing["kv_cache_bytes"] = int(max(0, rollout.memory_fraction * total - (total - free)))
        # Otherwise the engine sizes its cache to run every request to full length (host memory is plentiful
        # relative to the caches of CPU-sized models), so nothing is ever preempted. A null kv_block_size lets the
        # engine pick it from the attention backend (256 for flash-attn's paged kernel, else 16).
        return LLMEngine(
            model,
            eos_token_id=self.tokenizer.eos_token_id,
            block_size=rollout.kv_block_size,
            max_num_seqs=rollout.max_num_seqs,
            seed=self.config.trainer.seed,
            **sizing,
        )

    @data_parallel
    def generate_sequences(self, prompts: Batch, *, greedy: bool = False, samples: int | None = None) -> Batch:
        """``rollout.n`` responses per prompt (``samples`` if given; rows of one prompt consecutive, ``group_size =
        n``) in the rollout layout, responses padded to ``rollout.response_length`` so every DP shard has the same
        shape. ``greedy`` (validation, ReMax's baseline): one greedy response per prompt.

        With ``rollout.environment``, each response is a multi-turn trajectory (``envs.rollout``): ``response_mask``
        marks the tokens the policy generated (loss, KL, log-probs), ``attention_mask`` every token after the prompt
        too, and ``env_reward`` is each trajectory's environment reward; a GRPO group is the n trajectories of a
        prompt."""
        check_thread(self.device)
        rollout = self.config.rollout
        n, response_length = (1 if greedy else samples or rollout.n), rollout.response_length
        temperature = 0.0 if greedy else rollout.temperature
        # This rank's generation replica answers a share of the DP group's prompts; the rows are gathered back below.
        mine = prompts.select(self.hybrid.replica_rows(len(prompts)))
        prompt_tokens = [ids[mask.bool()].tolist() for ids, mask in zip(mine["input_ids"], mine["attention_mask"])]
        requests, params, sources = [], [], []
        for index, (tokens, uid) in enumerate(zip(prompt_tokens, mine["uid"].tolist())):
            for sample in range(n):
                requests.append(tokens)
                sources.append(index)
                params.append(
                    SamplingParams(
                        temperature=temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                        max_new_tokens=rollout.max_new_tokens, stop_token_ids=self.stop_token_ids,
                        seed=sample_seed(self.config.trainer.seed, uid, sample, n),
                    )
                )
        model = self.hybrid.generation_model(getattr(torch, self.config.model.dtype))
        engine = self._engine(model)
        per_row: dict[str, torch.Tensor] = {}
        if self.environment is None:
            outputs = engine.generate(requests, params)
            responses = [(out.generated_token_ids, [1] * out.num_generated, out.log_probs) for out in outputs]
            counters = [engine.num_preemptions]
        else:
            fields = ("data_source", "ground_truth", "extra_info")
            rows = [{"prompt": mine["raw_prompt"][i], **{key: mine[key][i] for key in fields}} for i in sources]
            environments = [self.environment() for _ in requests]
            trajectories, stats = run_multi_turn(
                engine, requests, environments, rows, params, delta=self.chat_delta, max_turns=rollout.max_turns,
                max_response_tokens=response_length, share=self.hybrid.on_replica_leader,
            )
            responses = [(t.response_token_ids, t.generated_mask, t.log_probs) for t in trajectories]
            counters = [stats.preemptions, stats.prefill_tokens, stats.cached_prefill_tokens]
            per_row = {
                "env_reward": torch.tensor([t.env_reward for t in trajectories]),
                "turns": torch.tensor([float(t.num_turns) for t in trajectories]),
            }
            for key in trajectories[0].env_metrics if trajectories else ():
                per_row[f"env/{key}"] = torch.tensor([float(t.env_metrics[key]) for t in trajectories])
        del engine, model  # the KV cache and the generation shard go before training resumes

        gathered = self.hybrid.gather_rows(
            {**response_tensors(responses, width=response_length, pad_token_id=self.pad_token_id), **per_row}
        )
        # Each replica counted its own engine work; the other DP groups' replicas add theirs below.
        counters = [self.hybrid.sum_over_replicas(value) for value in counters]
        repeated = prompts.repeat(n)
        rows = len(repeated)
        response_mask, trajectory_mask = gathered["response_mask"], gathered["trajectory_mask"]
        lengths = trajectory_mask.sum(dim=1).double()
        per_row_sums = [float(gathered[key].double().sum()) for key in per_row]
        sums, (longest, negated_shortest) = self.reducer.totals(
            [float(lengths.sum()), float(rows), float((trajectory_mask[:, -1] == 1).sum()),
             float(repeated["attention_mask"].sum()), float(response_mask.sum()), *counters, *per_row_sums],
            [float(lengths.max()), -float(lengths.min())],
        )
        (length_sum, row_count, clipped, prompt_tokens, generated), sums = sums[:5], sums[5:]
        engine_sums, row_sums = sums[: len(counters)], sums[len(counters) :]
        metrics = {
            "response_length/mean": length_sum / row_count,
            "response_length/max": longest,
            "response_length/min": -negated_shortest,
            "response_length/clip_ratio": clipped / row_count,
            "rollout/generated_tokens": generated,
            "rollout/prompt_tokens": prompt_tokens,
            "rollout/preemptions": engine_sums[0],
        }
        if self.environment is not None:
            metrics["rollout/observation_tokens"] = length_sum - generated
            for key, total in zip(("prefill_tokens", "cached_prefill_tokens"), engine_sums[1:]):
                metrics[f"rollout/{key}"] = total
            metrics.update({f"rollout/{key}/mean": total / row_count for key, total in zip(per_row, row_sums)})
        tensors = {
            "prompts": repeated["input_ids"],
            "responses": gathered["responses"],
            "response_mask": response_mask,
            "input_ids": torch.cat([repeated["input_ids"], gathered["responses"]], dim=1),
            "attention_mask": torch.cat([repeated["attention_mask"], trajectory_mask], dim=1),
            "rollout_log_probs": gathered["rollout_log_probs"],
            "uid": repeated["uid"],
        }
        if self.environment is not None:
            tensors["env_reward"] = gathered["env_reward"]
        return Batch(
            tensors,
            dict(repeated.non_tensors),
            {"metrics": metrics},
            group_size=n,
        )

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
        return self.model.forward_rows(
            batch, method, key, lambda logits, micro: self.model.response_log_probs(logits, micro, self.temperature)[0]
        )

    # ---- advantages --------------------------------------------------------------------------------------------

    @data_parallel
    def compute_advantages(
        self, *parts: Batch, estimator: str, kl_coef: float | None = None, source: str = "reward",
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
            data, estimator=estimator, algorithm=self.config.algorithm, reducer=self.reducer, source=source,
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
        self, logits: torch.Tensor, micro: MicroBatch, denominators, *, kl_coef: float, cost_multiplier: float | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        algorithm = self.config.algorithm
        aggregation = algorithm.loss_aggregation
        rows = micro.rows
        mask = rows["response_mask"].to(self.device)
        log_probs, entropy = self.model.response_log_probs(logits, micro, self.temperature, with_entropy=True)
        advantages = rows["advantages"]
        if cost_multiplier is not None:
            advantages = combine_advantages(advantages, rows["cost_advantages"], cost_multiplier)
        loss, metrics = policy_loss(
            log_probs, old_log_probs(rows).to(self.device), advantages.to(self.device), mask,
            clip_low=algorithm.clip_ratio_low, clip_high=algorithm.clip_ratio_high,
            aggregation=aggregation, denominators=denominators,
            ratio_level="sequence" if algorithm.policy_loss == "gspo" else "token",
        )
        if algorithm.entropy_coef:
            loss = loss - algorithm.entropy_coef * entropy_bonus(entropy, mask, aggregation=aggregation, denominators=denominators)
        if algorithm.kl_penalty == "loss":
            kl = kl_estimate(log_probs, rows["ref_log_probs"].to(self.device), algorithm.kl_estimator)
            loss = loss + kl_coef * aggregate(kl, mask, aggregation, denominators)
            metrics["actor/kl_loss"] = float(masked_mean(kl.detach(), mask))
        metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
        # FSDP sums gradients over DP ranks; the loss is this micro-batch's share of the global mini-batch loss.
        return loss, metrics

    @data_parallel
    def update_actor(self, *parts: Batch, kl_coef: float | None = None, cost_multiplier: float | None = None) -> dict[str, float]:
        """PPO epochs over the rows of ``parts`` (together: the rollout, ``advantages``, ``old_log_probs`` if
        recomputed, and ``ref_log_probs`` when the KL is a loss term); returns this rank's mean metrics.
        ``kl_coef``: the KL loss weight of this step (an adaptive controller's), else ``algorithm.kl_coef``.
        ``cost_multiplier`` (Safe-RLHF's λ): the policy follows (A_reward − λ·A_cost) / (1 + λ), with
        ``cost_advantages`` among ``parts``."""
        coef = self.config.algorithm.kl_coef if kl_coef is None else kl_coef
        loss = functools.partial(self._policy_loss, kl_coef=coef, cost_multiplier=cost_multiplier)
        return self.trainer.update(union_all(parts), loss, method="update_actor", prefix="actor")

    # ---- checkpoints and the Hugging Face copy -----------------------------------------------------------------

    @one_to_all
    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Sharded training state (weights, optimizer, LR schedule, RNG) for an exact resume, plus the model config
        and tokenizer that ``spmd-rlhf export`` needs to rebuild the model from it alone."""
        self.trainer.save(checkpoint_dir)

    @one_to_all
    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Restore what ``save_checkpoint`` wrote, whatever the DP size that wrote it."""
        self.trainer.load(checkpoint_dir)

    @one_to_all
    def save_pretrained(self, out_dir: str) -> str:
        """The current weights as a Hugging Face directory in ``trainer.save_hf_dtype`` (default ``model.dtype``),
        streamed from the shards (``ShardedModel.save_pretrained``); returns ``out_dir``."""
        return self.model.save_pretrained(out_dir)
