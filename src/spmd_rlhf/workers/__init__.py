"""Role workers, one file per role: actor, critic, reference, reward (rule or model; also the cost role), rollout
(generation-only replicas for asynchronous RL).

Each is the runtime's ``Worker`` plus composed parts: a ``DPReducer`` over its DP group (``reducer.py``), a
``ShardedModel`` for the roles that hold a model (``sharded_model.py``), a ``Trainer`` for those that train it
(``training.py``), and its own dispatched methods.
"""

from spmd_rlhf.training.reducer import DPReducer
from spmd_rlhf.training.sharded_model import ShardedModel
from spmd_rlhf.training.trainer import Trainer
from spmd_rlhf.workers.actor import ActorWorker
from spmd_rlhf.workers.critic import CriticWorker
from spmd_rlhf.workers.reference import ReferenceWorker
from spmd_rlhf.workers.reward import RewardWorker
from spmd_rlhf.workers.rollout import RolloutWorker

__all__ = [
    "ActorWorker",
    "CriticWorker",
    "DPReducer",
    "ReferenceWorker",
    "RewardWorker",
    "RolloutWorker",
    "ShardedModel",
    "Trainer",
]
