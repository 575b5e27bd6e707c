"""The critic: a value model (one value per token) trained on GAE returns with the clipped value loss."""

from __future__ import annotations

import torch

from ..algos import Denominators, masked_mean, value_loss
from ..config_schema import FrameworkConfig
from ..data.batch import Batch
from ..runtime import RoleContext, data_parallel
from .base import union_all
from .training import TrainedWorker


class CriticWorker(TrainedWorker):
    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.critic, head="value")

    @data_parallel
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` ``[rows, R]``: V of the state before each response token."""
        return self.forward_rows(
            batch, "compute_values", "values",
            lambda values, micro: self.response_outputs(values, micro).float() * micro["response_mask"].to(self.device),
        )

    def _value_loss(self, outputs: torch.Tensor, micro: Batch, denominators: Denominators) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro["response_mask"].to(self.device)
        values = self.response_outputs(outputs, micro).float()
        loss, metrics = value_loss(
            values, micro["values"].to(self.device), micro["returns"].to(self.device), mask,
            clip=self.config.algorithm.value_clip, aggregation=self.config.algorithm.loss_aggregation,
            denominators=denominators,
        )
        metrics["critic/values_mean"] = float(masked_mean(values.detach(), mask))
        return loss, metrics

    @data_parallel
    def update_critic(self, *parts: Batch) -> dict[str, float]:
        """Epochs of clipped value-loss steps over the rows of ``parts`` (together: the rollout, ``values`` from
        before the update and ``returns``)."""
        return self.trainer.update(union_all(parts), self._value_loss, method="update_critic", prefix="critic")
