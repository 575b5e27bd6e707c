"""The reference policy: a frozen copy of the initial actor, for the KL term."""

from __future__ import annotations

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import RoleContext, data_parallel, one_to_all
from spmd_rlhf.training.sharded_model import ShardedModel
from spmd_rlhf.workers.base import RoleWorker


class ReferenceWorker(RoleWorker):
    """A frozen ``ShardedModel`` with an LM head."""

    def __init__(self, context: RoleContext, config: FrameworkConfig) -> None:
        super().__init__(context, config, config.reference)
        self.model = ShardedModel(context, config, config.reference, head="lm", trainable=False, reducer=self.reducer)

    @data_parallel
    def compute_log_probs(self, batch: Batch) -> Batch:
        """``ref_log_probs`` ``[rows, R]`` of the responses, at the rollout temperature like the actor's."""
        temperature = self.config.rollout.temperature or 1.0
        return self.model.forward_rows(
            batch,
            "compute_log_probs",
            "ref_log_probs",
            lambda logits, micro: self.model.response_log_probs(logits, micro, temperature)[0],
        )

    @one_to_all
    def save_pretrained(self, out_dir: str) -> str:
        """The weights as a Hugging Face directory in ``trainer.save_hf_dtype`` (default ``model.dtype``), streamed
        from the shards (``ShardedModel.save_pretrained``); returns ``out_dir``."""
        return self.model.save_pretrained(out_dir)
