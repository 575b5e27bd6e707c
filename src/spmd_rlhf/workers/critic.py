"""The critic: a value model (one value per token) trained on GAE returns with the clipped value loss.

``role="critic"`` values the reward (``values``, ``returns``); ``role="cost_critic"`` (Safe-RLHF) values the cost
(``cost_values``, ``cost_returns``), with its own config section and metrics prefix.
"""

from __future__ import annotations

import torch

from spmd_rlhf.algos import Denominators, masked_mean, value_loss
from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import RoleContext, data_parallel
from spmd_rlhf.training.packing import MicroBatch
from spmd_rlhf.training.sharded_model import ShardedModel
from spmd_rlhf.training.trainer import Trainer
from spmd_rlhf.workers.base import TrainedRoleWorker, union_all

CRITIC_ROLES = {"critic": "", "cost_critic": "cost_"}
"""Critic role -> prefix of the batch keys it reads and writes."""


class CriticWorker(TrainedRoleWorker):
    """A value model: a ``ShardedModel`` with a value head and its ``Trainer``."""

    def __init__(self, context: RoleContext, config: FrameworkConfig, *, role: str = "critic") -> None:
        if role not in CRITIC_ROLES:
            raise ValueError(f"critic role {role!r} is unknown; choose one of {', '.join(CRITIC_ROLES)}")
        role_config = getattr(config, role)
        super().__init__(context, config, role_config)
        self.model = ShardedModel(context, config, role_config, head="value", trainable=True, reducer=self.reducer)
        self.trainer = Trainer(
            self.model,
            self.reducer,
            role_config,
            total_steps=config.trainer.total_steps,
            max_response_length=config.rollout.response_length,
            max_skipped_steps=config.trainer.max_skipped_steps,
        )
        self.role, self.keys = role, CRITIC_ROLES[role]

    @data_parallel
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` (``cost_values``) ``[rows, R]``: V of the state before each response token (0 past the
        response)."""
        return self.model.forward_rows(
            batch,
            "compute_values",
            f"{self.keys}values",
            lambda values, micro: micro.scatter(micro.response_outputs(values).float()),
        )

    def _value_loss(
        self, outputs: torch.Tensor, micro: MicroBatch, rows: Batch, denominators: Denominators
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The ``Trainer``'s loss function: ``rows`` are the micro-batch's rows on the model's device."""
        mask = rows["response_mask"]
        values = micro.scatter(micro.response_outputs(outputs).float())
        loss, metrics = value_loss(
            values,
            rows[f"{self.keys}values"],
            rows[f"{self.keys}returns"],
            mask,
            clip=self.config.algorithm.value_clip,
            aggregation=self.config.algorithm.loss_aggregation,
            denominators=denominators,
        )
        metrics = {key.replace("critic/", f"{self.role}/"): value for key, value in metrics.items()}
        metrics[f"{self.role}/values_mean"] = masked_mean(values.detach(), mask)
        return loss, metrics

    @data_parallel
    def update_critic(self, *parts: Batch) -> dict[str, float]:
        """Epochs of clipped value-loss steps over the rows of ``parts`` (together: the rollout, ``values`` from
        before the update and ``returns``, or their ``cost_`` versions)."""
        return self.trainer.update(union_all(parts), self._value_loss, method="update_critic", prefix=self.role)
