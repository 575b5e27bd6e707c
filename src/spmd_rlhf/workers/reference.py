"""The reference policy: a frozen copy of the initial actor, for the KL term."""

from __future__ import annotations

import torch

from ..config_schema import FrameworkConfig
from ..data.batch import Batch
from ..runtime import RoleContext, data_parallel
from .base import ModelWorker


class ReferenceWorker(ModelWorker):
    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.reference, head="lm", trainable=False)

    @data_parallel
    def compute_log_probs(self, batch: Batch) -> Batch:
        """``ref_log_probs`` ``[rows, R]`` of the responses, at the rollout temperature like the actor's."""
        self.model.eval()
        temperature = self.config.rollout.temperature or 1.0
        with torch.no_grad():
            parts = [self.response_log_probs(micro, temperature)[0] for micro in self.forward_micro_batches(batch, "compute_log_probs")]
        return Batch({"ref_log_probs": torch.cat(parts).cpu()}, group_size=batch.group_size)
