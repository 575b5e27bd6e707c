"""What every RL recipe shares: building the run (tiny assets, data, pools, roles), the fit loop, metrics, saving.

A recipe subclasses ``RLRecipe`` and writes ``step`` as the paper's controller program: a few calls on role handles.
Use it from your own loop:

    from spmd_rlhf.recipes.grpo import GRPORecipe
    from spmd_rlhf.config import load_config
    from spmd_rlhf.runtime import launch

    def main(coordinator):
        recipe = GRPORecipe(load_config("recipes/configs/grpo.yaml", ["trainer.total_steps=5"]), coordinator)
        recipe.setup()
        for step in range(5):
            print(recipe.step(step)["reward/mean"])

    launch(main)   # torchrun --nproc-per-node 4 my_loop.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spmd_rlhf import checkpoint
from spmd_rlhf.algos.kl import AdaptiveKLController, FixedKLController
from spmd_rlhf.config import ConfigError, FrameworkConfig, to_yaml
from spmd_rlhf.config.dataflow import KL_TO_ACTOR_BASE, ROLE_KINDS, Dataflow, algorithms_of, conditions
from spmd_rlhf.controller.dynamic_sampling import sample_with_signal
from spmd_rlhf.controller.role_handles import (
    WORKERS,
    ActorHandle,
    CriticHandle,
    ReferenceHandle,
    RewardHandle,
    RolloutHandle,
)
from spmd_rlhf.controller.rollout_pipeline import RolloutPipeline
from spmd_rlhf.controller.run import RecipeRun
from spmd_rlhf.controller.vocabularies import check_role_vocabularies
from spmd_rlhf.data.dataset import PromptDataset, PromptLoader
from spmd_rlhf.mapping.role_pools import place_roles
from spmd_rlhf.metrics.compile_counts import CompileCounts
from spmd_rlhf.metrics.peak_memory import step_memory_metrics
from spmd_rlhf.metrics.step_metrics import MetricsLogger, StageTimer, mean_over_ranks, step_passes, throughput_metrics
from spmd_rlhf.runtime import (
    BatchRef,
    CallFuture,
    Coordinator,
    RoleHandle,
    wait_together,
)
from spmd_rlhf.tiny import ensure_tiny_assets


@dataclass
class Experience:
    """What every algorithm's update starts from (``RLRecipe.experience``): the step's rollouts and what was computed
    on them, each a ``BatchRef`` to rows that stay on the workers."""

    rollout: BatchRef
    """Prompts, responses and the engine's log-probs."""
    scores: BatchRef
    """The reward of each response (under dynamic sampling the rollout itself, whose rows carry their scores)."""
    old_log_probs: BatchRef | None = None
    """Log-probs recomputed under the current policy, with ``rollout.recompute_log_probs``."""
    ref_log_probs: BatchRef | None = None
    """The reference's log-probs, when the run has a reference."""
    extras: dict[str, BatchRef] = field(default_factory=dict)
    """The results of ``experience``'s further calls, by keyword (``values``, ``costs``, ...)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics no batch carries (dynamic sampling's rounds and signal fraction)."""

    @property
    def batches(self) -> list[BatchRef]:
        """What the actor's advantages and update take: the rollout, its scores, and the log-probs there are."""
        parts = [self.rollout, self.scores, self.old_log_probs, self.ref_log_probs]
        return [part for index, part in enumerate(parts) if part is not None and part not in parts[:index]]


class RLRecipe(RecipeRun):
    """Setup, fit loop, metrics and saving; subclasses define ``step`` and declare its ``dataflow`` beside it."""

    name = "rl"
    dataflow: Dataflow | None = None
    """The roles the recipe's ``step`` uses and the work each does (``spmd_rlhf.config.dataflow``): config validation,
    the roles ``setup`` spawns, the mapper's workload, MFU and the dry run all follow it."""
    algorithms: tuple[str, ...] = ()
    """The ``algorithm.name`` values this recipe's ``step`` runs; empty: every one whose dataflow is ``dataflow``."""

    @classmethod
    def runs(cls) -> tuple[str, ...]:
        """The ``algorithm.name`` values this recipe runs."""
        return cls.algorithms or (algorithms_of(cls.dataflow) if cls.dataflow else ())

    @classmethod
    def check_algorithm(cls, config: FrameworkConfig) -> None:
        """A ``ConfigError`` naming both when ``algorithm.name`` is not one this recipe runs (a PPO config given to
        the GRPO recipe would otherwise fail mid-setup, far from the cause)."""
        if config.algorithm.name not in cls.runs():
            raise ConfigError(
                f"algorithm.name={config.algorithm.name}: the {cls.name} recipe runs {', '.join(cls.runs())}; run "
                f"the recipe of that algorithm (recipes/<algorithm>.py) or set algorithm.name to one of these"
            )

    def __init__(self, config: FrameworkConfig, coordinator: Coordinator) -> None:
        self.check_algorithm(config)
        self.config = config
        self.coordinator = coordinator
        self.roles: dict[str, RoleHandle] = {}
        algorithm = config.algorithm
        self.kl_controller = (
            AdaptiveKLController(algorithm.kl_coef, algorithm.kl_target, algorithm.kl_horizon)
            if algorithm.kl_target is not None
            else FixedKLController(algorithm.kl_coef)
        )
        """The KL weight of each step (``kl_controller.coef``), updated from the step's ``kl/mean``; checkpointed."""
        self.config_yaml = to_yaml(config)
        """The resolved config as given (before placement fills in layouts): saved at the run's start and in every
        checkpoint, and compared with a checkpoint's on resume."""
        self.pipeline: RolloutPipeline | None = None
        """With a rollout role: the batches generated ahead (``controller.rollout_pipeline``), made at the first
        step."""
        self.stopped_by: str | None = None
        """Why ``fit`` ended before ``trainer.total_steps`` (``"SIGTERM on rank 1"``); None when it ran them all."""
        self.compile_counts = CompileCounts()
        """What TorchDynamo compiled in this process each step (``compile/graphs``, ``compile/seconds``)."""

    # ---- building ----------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Tiny assets if needed, the metric sinks (first, so a missing sink package fails at once) and the step's
        model passes for MFU, the prompt loader, and every enabled role on its pool (built concurrently)."""
        from transformers import AutoTokenizer

        ensure_tiny_assets(self.config)
        placement = place_roles(self.config, self.coordinator.world_size)
        self.config = config = placement.config
        if placement.plan:
            print(placement.plan, end="", flush=True)
        try:  # at once, not at the first save after hours of training
            checkpoint.writable_dir(config.trainer.output_dir)
        except checkpoint.CheckpointError as error:
            raise checkpoint.CheckpointError(f"trainer.output_dir: {error}") from None
        self.metrics_logger = MetricsLogger(config)
        self.model_passes = step_passes(config)
        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path or config.model.path)
        check_role_vocabularies(config, tokenizer)

        def prompts(files: list[str]) -> PromptDataset:
            return PromptDataset(
                files,
                tokenizer,
                prompt_key=config.data.prompt_key,
                max_prompt_length=config.data.max_prompt_length,
                overlong_prompts=config.data.overlong_prompts,
            )

        dataset = prompts(config.data.train_files)
        self.data_metrics = {
            "data/skipped_prompts": float(dataset.num_skipped),
            "data/truncated_prompts": float(dataset.num_truncated),
        }
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.loader = PromptLoader(
            dataset,
            batch_size=config.data.batch_size,
            pad_token_id=pad,
            shuffle=config.data.shuffle,
            seed=config.data.seed,
        )
        self.val_prompts = None
        if config.data.val_files:
            val = prompts(config.data.val_files)
            self.val_prompts = PromptLoader(val, batch_size=len(val), pad_token_id=pad, shuffle=False).batch(0)
        for name in self.dataflow.roles_of(config):
            pool, dims = placement.roles[name]
            kind = ROLE_KINDS[name].worker
            worker, handle = WORKERS[kind]
            arguments = {"role": name} if name != kind else {}
            self.roles[name] = self.coordinator.spawn(
                worker, config, **arguments, name=name, pool=pool, dims=dims, handle=handle
            )
        for role in self.roles.values():
            role.ready.result()

    # ---- the roles of this run ---------------------------------------------------------------------------------

    @property
    def actor(self) -> ActorHandle:
        return self._role("actor")

    @property
    def critic(self) -> CriticHandle:
        return self._role("critic")

    @property
    def reference(self) -> ReferenceHandle:
        return self._role("reference")

    @property
    def reward(self) -> RewardHandle:
        return self._role("reward")

    @property
    def rollout(self) -> RolloutHandle:
        return self._role("rollout")

    @property
    def cost(self) -> RewardHandle:
        return self._role("cost")

    @property
    def cost_critic(self) -> CriticHandle:
        return self._role("cost_critic")

    def _role(self, name: str) -> Any:
        if name not in self.roles:
            if not self.roles:
                raise RuntimeError(
                    f"the {self.name} recipe has no roles yet: call setup() (or fit()) before its {name}"
                )
            raise RuntimeError(
                f"the {name} is not in this run: the {self.name} recipe with algorithm.name="
                f"{self.config.algorithm.name} uses {', '.join(self.roles)}"
            )
        return self.roles[name]

    # ---- one step ----------------------------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def experience(self, step: int, timer: StageTimer, **also: Callable[[BatchRef], CallFuture]) -> Experience:
        """What every algorithm's update starts from: the step's rollouts (with the engine's log-probs), their scores,
        their log-probs recomputed under the current policy if ``rollout.recompute_log_probs``, and under the
        reference if there is one; and in ``extras`` the results of ``also`` (further calls on the rollouts, such as
        a critic's ``values=self.critic.compute_values``).

        Every call after generation is issued at once (``run_together``): roles placed on different devices run
        at the same time, colocated ones one after another."""
        sampling_metrics: dict[str, float] = {}
        if "rollout" in self.roles:
            if self.pipeline is None:
                self.pipeline = self.rollout_pipeline(start=step)
            rollout, scores, sampling_metrics = self.pipeline.take(step, timer)
            calls = {"reward": scores}
        elif self.config.algorithm.dynamic_sampling:
            rollout, sampling_metrics = sample_with_signal(
                self.config, actor=self.actor, reward=self.reward, loader=self.loader, step=step, timer=timer
            )
            calls = {}
        else:
            with timer("generate"):
                rollout = self.actor.generate_sequences(self.loader.batch(step)).result()
            calls = {"reward": self.reward.compute_rewards(rollout)}
        if self.config.rollout.recompute_log_probs:
            calls["old_log_probs"] = self.actor.compute_log_probs(rollout)
        if "reference" in self.roles:
            calls["ref_log_probs"] = self.reference.compute_log_probs(rollout)
        elif conditions(self.config)[KL_TO_ACTOR_BASE.name]:
            # LoRA: the reference is the actor's base, its adapters switched off (no reference role exists).
            calls["ref_log_probs"] = self.actor.compute_ref_log_probs(rollout)
        calls.update((name, call(rollout)) for name, call in also.items())
        results = dict(zip(calls, self.run_together(timer, **calls)))
        return Experience(
            rollout,
            scores=results.pop("reward", rollout),
            old_log_probs=results.pop("old_log_probs", None),
            ref_log_probs=results.pop("ref_log_probs", None),
            extras=results,
            metrics=sampling_metrics,
        )

    def rollout_pipeline(self, *, start: int) -> RolloutPipeline:
        """The rollout role's batches generated ahead, for a run starting (or resuming) at step ``start``."""
        return RolloutPipeline(
            actor=self.actor,
            rollout=self.rollout,
            reward=self.reward,
            loader=self.loader,
            max_staleness=self.config.algorithm.max_staleness,
            total_steps=self.config.trainer.total_steps,
            start=start,
            timeout_s=self.config.trainer.timeout_s,
            background_sync=self.config.rollout.background_sync,
            partial_rollouts=self.config.rollout.partial_rollouts,
            greedy_baseline=self.dataflow is not None and any(work.kind == "greedy" for work in self.dataflow.work),
        )

    def update_options(self, step: int) -> dict[str, Any]:
        """The actor update's keywords at step ``step``: this step's KL weight and, with a rollout role, the policy
        version (updates taken so far) that the samples' token versions are measured against."""
        options: dict[str, Any] = {"kl_coef": self.kl_controller.coef}
        if "rollout" in self.roles:
            options["policy_version"] = step
        return options

    def run_together(self, timer: StageTimer, **calls: CallFuture) -> list[Any]:
        """The results of calls already issued, in keyword order, each timed as ``time/<keyword>`` from now until
        the controller saw it complete; at most ``trainer.timeout_s`` in all (``runtime.wait_together``)."""
        return wait_together(calls, timeout_s=self.config.trainer.timeout_s, on_done=timer.add)

    def step_metrics(self, started: float, timer: StageTimer, *results: Any) -> dict[str, float]:
        """The step's metrics: those the workers put in batch meta or returned per DP rank (an ``Experience``
        gives its ``batches``' and its own), stage times, step time, throughput (tokens per second in all and per
        device, generated tokens per second of generation) and model TFLOP/s per device and MFU
        (``spmd_rlhf.metrics.step_metrics.throughput_metrics``), what TorchDynamo compiled in this process
        (``spmd_rlhf.metrics.compile_counts``) and, on CUDA, rank 0's peak device memory over the step
        (``spmd_rlhf.metrics.peak_memory.step_memory_metrics``)."""
        metrics: dict[str, float] = {}
        for result in results:
            if isinstance(result, Experience):
                for batch in result.batches:
                    metrics.update(batch.meta.get("metrics", {}))
                metrics.update(result.metrics)
            elif isinstance(result, list):
                metrics.update(mean_over_ranks(result))
            else:
                metrics.update(result.meta.get("metrics", {}))
        metrics.update(timer.metrics())
        metrics["time/step"] = time.perf_counter() - started
        metrics.update(step_memory_metrics())
        metrics.update(self.compile_counts.step_metrics())
        metrics.update(
            throughput_metrics(
                metrics,
                world_size=self.coordinator.world_size,
                passes=self.model_passes,
                peak_flops_per_device=self.config.trainer.peak_flops_per_device,
            )
        )
        return metrics
