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

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd_rlhf import checkpoint
from spmd_rlhf.algos.evaluation import pass_at_k
from spmd_rlhf.algos.kl import AdaptiveKLController, FixedKLController
from spmd_rlhf.checkpoint import run_directory
from spmd_rlhf.config import ConfigError, config_reference, load_config, to_yaml
from spmd_rlhf.config_schema import FrameworkConfig
from spmd_rlhf.data.dataset import PromptDataset, PromptLoader
from spmd_rlhf.dataflow import KL_TO_ACTOR_BASE, ROLE_KINDS, Dataflow, algorithms_of, conditions
from spmd_rlhf.mapping.role_pools import place_roles
from spmd_rlhf.metrics.sinks import truncate_metrics
from spmd_rlhf.metrics.step_metrics import MetricsLogger, StageTimer, mean_over_ranks, step_passes, throughput_metrics
from spmd_rlhf.models.vocabulary import check_role_vocabularies
from spmd_rlhf.recipes.async_rollouts import RolloutPipeline
from spmd_rlhf.recipes.dry_run import describe
from spmd_rlhf.recipes.dynamic_sampling import sample_with_signal
from spmd_rlhf.recipes.roles import WORKERS, ActorHandle, CriticHandle, ReferenceHandle, RewardHandle, RolloutHandle
from spmd_rlhf.runtime import (
    REQUEUE_EXIT_CODE,
    BatchRef,
    CallFuture,
    Coordinator,
    RoleHandle,
    RuntimeOptions,
    launch,
    stop_requested,
    wait_together,
)
from spmd_rlhf.runtime.device import select_device, visible_cuda_devices
from spmd_rlhf.runtime.host_memory import restart_with_huge_pages
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


class RLRecipe:
    """Setup, fit loop, metrics and saving; subclasses define ``step`` and declare its ``dataflow`` beside it."""

    name = "rl"
    dataflow: Dataflow | None = None
    """The roles the recipe's ``step`` uses and the work each does (``spmd_rlhf.dataflow``): config validation, the
    roles ``setup`` spawns, the mapper's workload, MFU and the dry run all follow it."""
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
        """With a rollout role: the batches generated ahead (``recipes.async_rollouts``), made at the first step."""
        self.stopped_by: str | None = None
        """Why ``fit`` ended before ``trainer.total_steps`` (``"SIGTERM on rank 1"``); None when it ran them all."""

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
        (``spmd_rlhf.metrics.step_metrics.throughput_metrics``)."""
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
        metrics.update(
            throughput_metrics(
                metrics,
                world_size=self.coordinator.world_size,
                passes=self.model_passes,
                peak_flops_per_device=self.config.trainer.peak_flops_per_device,
            )
        )
        return metrics

    # ---- the loop ----------------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        """Run up to ``trainer.total_steps`` steps (resuming as ``trainer.resume`` says), logging each and saving as
        configured; returns the metrics of the steps run. The run directory is locked for the whole run
        (``run_directory.RunLock``); the resolved config goes into it, and ``metrics.jsonl`` keeps only the steps
        before the one resumed from. On SIGTERM/SIGUSR1 (``runtime.stop_requested``) it saves after the step in
        flight and ends early, naming the cause in ``stopped_by``."""
        output_dir = self.config.trainer.output_dir
        lock = run_directory.RunLock(output_dir)
        lock.acquire()  # before any model loads: a second job on this directory fails at once, naming the holder
        try:
            checkpoint_dir = self.resume_checkpoint()
            if not self.roles:
                self.setup()
            run_directory.clear_stopped(output_dir)
            start = self.load(checkpoint_dir) if checkpoint_dir else 0
            run_directory.write_run_config(output_dir, self.config_yaml)
            truncate_metrics(output_dir, start)
            return self.train_steps(start)
        finally:
            lock.release()

    def train_steps(self, start: int) -> list[dict[str, float]]:
        """Steps ``start`` .. ``total_steps - 1``, each logged, with saves every ``trainer.save_every`` steps (null:
        a tenth of the run), after ``trainer.save_every_minutes``, after the last step, and when a stop is requested."""
        trainer = self.config.trainer
        steps_between_saves = trainer.steps_between_saves()
        saved_at = time.monotonic()
        history = []
        done = saved = start  # steps finished, and the step of the last checkpoint
        for step in range(start, trainer.total_steps):
            if stop_requested():
                break
            sent, received = self.coordinator.bytes_sent, self.coordinator.bytes_received
            metrics = self.step(step)
            metrics.update(self.data_metrics)
            metrics["kl/coef"] = self.kl_controller.coef
            if "kl/mean" in metrics:
                self.kl_controller.update(metrics["kl/mean"], steps=self.config.data.batch_size * self.config.rollout.n)
            done = step + 1
            last = done == trainer.total_steps
            if trainer.val_every and (done % trainer.val_every == 0 or last):
                metrics.update(self.validate())
            # Control-plane bytes of the step: O(batch) (prompts, handles, metrics), never per-token tensors.
            metrics["coordinator/bytes_sent"] = self.coordinator.bytes_sent - sent
            metrics["coordinator/bytes_received"] = self.coordinator.bytes_received - received
            history.append(metrics)
            if step % trainer.log_every == 0 or last:
                self.metrics_logger.log(step, metrics)
            if checkpoint.save_due(
                done,
                total_steps=trainer.total_steps,
                save_every=steps_between_saves,
                minutes_since_save=(time.monotonic() - saved_at) / 60,
                save_every_minutes=trainer.save_every_minutes,
            ):
                self.save(os.path.join(trainer.output_dir, f"step_{done}"), step=done, final=last)
                saved, saved_at = done, time.monotonic()
        if done < trainer.total_steps and stop_requested():
            self.stopped_by = stop_requested()
            if saved < done:
                self.save(os.path.join(trainer.output_dir, f"step_{done}"), step=done)
            run_directory.mark_stopped(trainer.output_dir, reason=self.stopped_by, step=done)
            resumable = f"step_{done}" if done else "the start"
            print(
                f"{self.stopped_by}: stopped after step {done} of {trainer.total_steps}; a relaunch continues from "
                f"{resumable}",
                flush=True,
            )
        self.metrics_logger.close()
        return history

    def validate(self) -> dict[str, float]:
        """One greedy response to every validation prompt, scored by the reward role, and with
        ``trainer.val_samples = k`` also k sampled ones: ``val/reward/mean``, ``val/response_length/mean``,
        ``val/sampled/reward/mean`` and ``val/pass@k`` (the coordinator sees one score per response)."""
        timer, trainer = StageTimer(), self.config.trainer
        with timer("validate"):
            rollout = self.actor.generate_sequences(self.val_prompts, greedy=True).result()
            scores = self.reward.compute_rewards(rollout).result()
            metrics = {
                "val/reward/mean": scores.meta["metrics"]["reward/mean"],
                "val/response_length/mean": rollout.meta["metrics"]["response_length/mean"],
            }
            if trainer.val_samples:
                sampled = self.actor.generate_sequences(self.val_prompts, samples=trainer.val_samples).result()
                sampled_scores = self.reward.compute_rewards(sampled).result().fetch()["scores"]
                passed = (sampled_scores >= trainer.val_pass_score).reshape(-1, trainer.val_samples)
                metrics["val/sampled/reward/mean"] = float(sampled_scores.double().mean())
                metrics[f"val/pass@{trainer.val_samples}"] = float(pass_at_k(passed, trainer.val_samples).mean())
        return {**metrics, **timer.metrics()}

    def trained_roles(self) -> list[str]:
        """The run's roles whose training state a checkpoint holds (``ROLE_KINDS``' trained roles)."""
        return [name for name in self.roles if ROLE_KINDS[name].trained]

    def save(self, out_dir: str, *, step: int, final: bool = False) -> str:
        """A checkpoint after ``step`` steps: each trained role's sharded training state (DCP, for an exact resume,
        and for ``spmd-rlhf export``), its weights as a Hugging Face directory (``<out_dir>/actor``) when
        ``trainer.save_hf`` asks for them (``final``: this is the save after the last step), and
        ``trainer_state.json``. Atomic (``spmd_rlhf.checkpoint.write_checkpoint``): a crash mid-save leaves the
        previous checkpoint and ``latest`` as they were."""
        with_hf = checkpoint.hf_copy_due(self.config.trainer.save_hf, last=final)

        trainer_state = {"step": step, "recipe": self.name, "algorithm": self.algorithm_state()}

        def write_roles(staging: Path) -> None:
            for name in self.trained_roles():
                self.roles[name].save_checkpoint(str(checkpoint.role_state_dir(staging, name))).result()
                if with_hf:
                    self.roles[name].save_pretrained(str(checkpoint.role_hf_dir(staging, name))).result()
            if self.pipeline is not None:  # before trainer_state.json, which write_checkpoint writes after this
                trainer_state["rollouts"] = self.pipeline.save(str(staging))

        return str(
            checkpoint.write_checkpoint(
                out_dir,
                write_roles,
                trainer_state=trainer_state,
                config_yaml=self.config_yaml,
                keep_last=self.config.trainer.keep_last,
            )
        )

    def algorithm_state(self) -> dict[str, Any]:
        """The controller's state between steps (JSON-able), saved in checkpoints: the KL weight. Recipes with more
        (a Lagrange multiplier) extend it and ``load_algorithm_state``."""
        return {"kl_coef": self.kl_controller.coef}

    def load_algorithm_state(self, state: dict[str, Any]) -> None:
        self.kl_controller.coef = float(state["kl_coef"])

    def load(self, checkpoint_dir: str) -> int:
        """Restore the trained roles from a checkpoint written by ``save`` (by any number of ranks); returns the step
        to continue from."""
        state = checkpoint.read_trainer_state(checkpoint_dir)
        self.check_recipe(checkpoint_dir, state)
        state_dirs = {name: checkpoint.require_role_state(checkpoint_dir, name) for name in self.trained_roles()}
        for name, state_dir in state_dirs.items():
            self.roles[name].load_checkpoint(str(state_dir)).result()
        self.load_algorithm_state(state.get("algorithm", self.algorithm_state()))
        if "rollouts" in state:
            self.pipeline = self.rollout_pipeline(start=int(state["step"]))
            self.pipeline.restore(checkpoint_dir, state["rollouts"])
        return int(state["step"])

    def check_recipe(self, checkpoint_dir: str | os.PathLike, state: dict[str, Any]) -> None:
        """A ``CheckpointError`` when ``checkpoint_dir`` (whose ``trainer_state.json`` is ``state``) was written by
        another recipe."""
        if state["recipe"] != self.name:
            raise checkpoint.CheckpointError(
                f"{checkpoint_dir} was written by the {state['recipe']} recipe, not {self.name}; resume it with that "
                f"recipe, or start fresh with trainer.resume=null or another trainer.output_dir"
            )

    def resume_checkpoint(self) -> str | None:
        """The checkpoint ``trainer.resume`` points at: auto = ``<output_dir>``'s latest if it has one, null = none
        (refused when ``<output_dir>`` holds checkpoints), else a checkpoint directory or a run directory (meaning its
        latest). A checkpoint of another recipe, data order or model, or one that already reached
        ``trainer.total_steps``, is refused (``run_directory.check_resume``); other config changes are printed."""
        trainer = self.config.trainer
        resume = trainer.resume
        if resume is None:
            run_directory.check_fresh_start(trainer.output_dir, checkpoint.latest_checkpoint(trainer.output_dir))
            return None
        if resume == "auto":
            found = checkpoint.latest_checkpoint(trainer.output_dir)
            if found is None:
                return None
        else:
            try:
                found = checkpoint.resolve_checkpoint(resume)
            except checkpoint.CheckpointError as error:
                raise checkpoint.CheckpointError(f"trainer.resume={resume}: {error}") from error
        self.check_recipe(found, checkpoint.read_trainer_state(found))
        changes = run_directory.check_resume(
            found,
            config_yaml=self.config_yaml,
            total_steps=trainer.total_steps,
            allow_changes=trainer.resume_allow_changes,
        )
        shown = ", ".join(f"{key} ({saved!r} -> {now!r})" for key, (saved, now) in changes.items())
        print(f"resuming from {found}" + (f"; config changed since it was saved: {shown}" if shown else ""), flush=True)
        return str(found)


def main(recipe_class: type[RLRecipe], default_config: str) -> None:
    """The torchrun entry of a recipe: ``--config FILE`` then ``key=value`` overrides; ``--help`` lists every key,
    ``--dry-run`` prints what would run (config, placement, layouts, memory per rank) and exits."""
    parser = argparse.ArgumentParser(
        description=f"The {recipe_class.name} recipe. Run it under torchrun; every key below can be set as key=value.",
        epilog="config keys (default, meaning):\n" + config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=default_config, help="YAML config (default: %(default)s)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, placement, role layouts and memory per rank, then exit",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="ranks to plan for with --dry-run (default: $WORLD_SIZE or 1)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=5")
    options = parser.parse_args()
    try:
        config = load_config(options.config, options.overrides)
        recipe_class.check_algorithm(config)
        if options.dry_run:
            if int(os.environ.get("RANK", "0")) == 0:
                print(describe(config, options.world_size), end="")
            return
        # Which device the launch will pick, by the launch's own rule (any rank's: they all see the same devices).
        on_cpu = (
            select_device(config.trainer.device, local_rank=0, cuda_devices=visible_cuda_devices())[0].type == "cpu"
        )
    except (ConfigError, ValueError) as error:
        parser.exit(2, f"{recipe_class.name}: {error}\n")
    if config.trainer.host_huge_pages and on_cpu:
        restart_with_huge_pages()
    trainer = config.trainer
    runtime = RuntimeOptions(
        call_timeout_s=trainer.timeout_s,
        collective_timeout_s=trainer.collective_timeout_s,
        device=trainer.device,
        stop_timeout_s=trainer.stop_timeout_s,
    )

    def run(coordinator: Coordinator) -> str | None:
        recipe = recipe_class(config, coordinator)
        recipe.fit()
        return recipe.stopped_by

    stopped_by = launch(run, options=runtime)
    # RPC and the process groups are shut down and the sinks closed; skip interpreter teardown, where a C++ thread
    # of the distributed stack left joinable can abort the process ("terminate called without an active exception",
    # seen once in ~600 recipe runs) and turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(REQUEUE_EXIT_CODE if stopped_by else 0)
