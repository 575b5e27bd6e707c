"""What every role worker shares: the runtime's ``Worker`` (context, mesh, device) plus its config and a ``DPReducer``
over its DP group. The rest of a role is composed, not inherited: a ``ShardedModel`` (``training.sharded_model``) for
the roles that hold a model, a ``Trainer`` (``training.trainer``) for the ones that train it, and the role's own
dispatched methods (one file per role). The trained roles (actor, critic) share their checkpoint endpoints through
``TrainedRoleWorker``.
"""

from __future__ import annotations

from spmd_rlhf.config import FrameworkConfig, RoleConfig
from spmd_rlhf.data.batch import Batch
from spmd_rlhf.runtime import RoleContext, Worker, one_to_all
from spmd_rlhf.training.reducer import DPReducer


def union_all(parts: tuple[Batch, ...]) -> Batch:
    """The fields of several batches over the same rows (e.g. a rollout, its scores and its log-probs) as one."""
    batch = parts[0]
    for part in parts[1:]:
        batch = batch.union(part)
    return batch


class RoleWorker(Worker):
    """A role of the RL loop: its config, and ``reducer`` over its DP group."""

    def __init__(self, context: RoleContext, config: FrameworkConfig, role_config: RoleConfig) -> None:
        super().__init__(context)
        self.config = config
        self.role_config = role_config
        self.reducer = DPReducer(self.mesh["dp"].get_group(), role=context.name)


class TrainedRoleWorker(RoleWorker):
    """A role that trains its model (actor, critic): a subclass sets ``model`` (a ``ShardedModel``) and ``trainer``
    (a ``Trainer``); the checkpoint endpoints below are the same for every such role."""

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
