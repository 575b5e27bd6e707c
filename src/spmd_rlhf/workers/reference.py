"""The reference policy: a frozen copy of the initial actor, for the KL term."""

from __future__ import annotations


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
        temperature = self.config.rollout.temperature or 1.0
        return self.forward_rows(
            batch, "compute_log_probs", "ref_log_probs", lambda logits, micro: self.response_log_probs(logits, micro, temperature)[0]
        )
