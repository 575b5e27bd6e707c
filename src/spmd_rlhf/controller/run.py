"""The run of a recipe: ``fit`` (resume, the steps, validation, saves on a cadence and on a signal), ``save`` and
``load`` of the whole run (every trained role, the algorithm's state, the rollout pipeline)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from spmd_rlhf import checkpoint
from spmd_rlhf.algos.evaluation import pass_at_k
from spmd_rlhf.checkpoint import run_directory
from spmd_rlhf.config.dataflow import ROLE_KINDS
from spmd_rlhf.metrics.profiling import profiled
from spmd_rlhf.metrics.sinks import restart_metrics, truncate_metrics
from spmd_rlhf.metrics.step_metrics import StageTimer
from spmd_rlhf.runtime import (
    stop_requested,
)


class RecipeRun:
    """The run's lifecycle, shared by every recipe; ``RLRecipe`` adds the roles and the experience a step uses."""

    fault_metrics: dict[str, int] = {}
    """``faults/restarts`` and ``faults/steps_redone`` (``metrics.sinks.restart_metrics``), set by ``fit`` and logged
    with every step."""

    # ---- the loop ----------------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        """Run up to ``trainer.total_steps`` steps (resuming as ``trainer.resume`` says), logging each and saving as
        configured; returns the metrics of the steps run. The run directory is locked for the whole run
        (``run_directory.RunLock``); the resolved config goes into it, and ``metrics.jsonl`` keeps only the steps
        before the one resumed from (what it cut counts as steps redone: ``fault_metrics``). On SIGTERM/SIGUSR1
        (``runtime.stop_requested``) it saves after the step in flight and ends early, naming the cause in
        ``stopped_by``."""
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
            self.fault_metrics = restart_metrics(truncate_metrics(output_dir, start), start)
            if self.fault_metrics["faults/restarts"]:
                print(
                    f"torchrun restart {self.fault_metrics['faults/restarts']}: continuing from step {start}; "
                    f"{self.fault_metrics['faults/steps_redone']} steps of this run directory done again so far",
                    flush=True,
                )
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
            profile = Path(trainer.output_dir, "profile", f"step_{step}.txt") if step in trainer.profile_steps else None
            trace = profile.with_suffix(".json.gz") if profile and trainer.profile_trace else None
            with profiled(profile, trace=trace):
                metrics = self.step(step)
            metrics.update(self.data_metrics)
            metrics.update(self.fault_metrics)
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
