"""Typed handles of the built-in roles: one method per dispatched method of the role's worker, each forwarding to
``RoleHandle.call``, so a recipe's call can be followed to the worker method it runs (``self.actor.update_actor``
-> ``ActorWorker.update_actor``). Every call returns a ``CallFuture`` at once; batches go in as ``BatchRef`` s or
futures of them and stay on the workers.

``WORKERS`` says which worker class and handle serve each worker kind of ``spmd_rlhf.config.dataflow.ROLE_KINDS``.
"""

from __future__ import annotations

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import BatchRef, CallFuture, RoleHandle
from spmd_rlhf.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker

Rows = BatchRef | CallFuture | Batch
"""What a data-parallel method takes: rows on the workers (or a future of them), or a batch from the coordinator."""


class TrainedHandle(RoleHandle):
    """A role with an optimizer: its sharded training state and its weights as a Hugging Face directory."""

    def save_checkpoint(self, checkpoint_dir: str) -> CallFuture:
        return self.call("save_checkpoint", checkpoint_dir)

    def load_checkpoint(self, checkpoint_dir: str) -> CallFuture:
        return self.call("load_checkpoint", checkpoint_dir)

    def save_pretrained(self, out_dir: str) -> CallFuture:
        return self.call("save_pretrained", out_dir)


class ActorHandle(TrainedHandle):
    """``ActorWorker``: generation through the 3D-HybridEngine, log-probs, advantages and the policy update."""

    def generate_sequences(self, prompts: Rows, *, greedy: bool = False, samples: int | None = None) -> CallFuture:
        return self.call("generate_sequences", prompts, greedy=greedy, samples=samples)

    def select_rows(self, *parts: Rows, keep: Batch) -> CallFuture:
        return self.call("select_rows", *parts, keep=keep)

    def concat_rows(self, *batches: Rows) -> CallFuture:
        return self.call("concat_rows", *batches)

    def compute_log_probs(self, batch: Rows) -> CallFuture:
        return self.call("compute_log_probs", batch)

    def compute_ref_log_probs(self, batch: Rows) -> CallFuture:
        return self.call("compute_ref_log_probs", batch)

    def compute_advantages(
        self,
        *parts: Rows,
        estimator: str,
        kl_coef: float | None = None,
        source: str = "reward",
        baseline: Rows | None = None,
    ) -> CallFuture:
        return self.call(
            "compute_advantages", *parts, estimator=estimator, kl_coef=kl_coef, source=source, baseline=baseline
        )

    def update_actor(
        self,
        *parts: Rows,
        kl_coef: float | None = None,
        cost_multiplier: float | None = None,
        policy_version: int | None = None,
    ) -> CallFuture:
        return self.call(
            "update_actor", *parts, kl_coef=kl_coef, cost_multiplier=cost_multiplier, policy_version=policy_version
        )

    def send_weights(self, version: int) -> CallFuture:
        return self.call("send_weights", version)


class CriticHandle(TrainedHandle):
    """``CriticWorker`` (the critic and the cost critic): values and the value update."""

    def compute_values(self, batch: Rows) -> CallFuture:
        return self.call("compute_values", batch)

    def update_critic(self, *parts: Rows) -> CallFuture:
        return self.call("update_critic", *parts)


class ReferenceHandle(RoleHandle):
    """``ReferenceWorker``: the frozen initial policy's log-probs."""

    def compute_log_probs(self, batch: Rows) -> CallFuture:
        return self.call("compute_log_probs", batch)


class RewardHandle(RoleHandle):
    """``RewardWorker`` (the reward and the cost): one score per response, from a rule or a model."""

    def compute_rewards(self, batch: Rows) -> CallFuture:
        return self.call("compute_rewards", batch)


class RolloutHandle(RoleHandle):
    """``RolloutWorker``: generation replicas on their own ranks, fed the actor's weights."""

    def generate_sequences(self, prompts: Rows, *, greedy: bool = False, samples: int | None = None) -> CallFuture:
        return self.call("generate_sequences", prompts, greedy=greedy, samples=samples)

    def receive_weights(self, version: int) -> CallFuture:
        return self.call("receive_weights", version)

    def start_generation(self, prompts: Rows, *, batch: int) -> CallFuture:
        return self.call("start_generation", prompts, batch=batch)

    def continue_generation(self, *, batch: int) -> CallFuture:
        return self.call("continue_generation", batch=batch)

    def finish_generation(self, prompts: Rows, *, batch: int) -> CallFuture:
        return self.call("finish_generation", prompts, batch=batch)

    def save_generation(self, directory: str, *, batch: int) -> CallFuture:
        return self.call("save_generation", directory, batch=batch)

    def restore_generation(self, prompts: Rows, directory: str, *, batch: int) -> CallFuture:
        return self.call("restore_generation", prompts, directory, batch=batch)

    def save_rows(self, batch: Rows, directory: str) -> CallFuture:
        return self.call("save_rows", batch, directory)

    def restore_rows(self, prompts: Rows, directory: str) -> CallFuture:
        return self.call("restore_rows", prompts, directory)


WORKERS: dict[str, tuple[type, type[RoleHandle]]] = {
    "actor": (ActorWorker, ActorHandle),
    "critic": (CriticWorker, CriticHandle),
    "reference": (ReferenceWorker, ReferenceHandle),
    "reward": (RewardWorker, RewardHandle),
    "rollout": (RolloutWorker, RolloutHandle),
}
"""A worker kind (``RoleKind.worker``) -> its worker class and typed handle. A role whose name is not its kind
(cost, cost_critic) is built with ``role=<name>``."""
