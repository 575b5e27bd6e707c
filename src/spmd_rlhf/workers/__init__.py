"""Role workers, one file per role: actor, critic, reference, reward (rule or model; also the cost role), rollout
(generation-only replicas for asynchronous RL).

Each is the runtime's ``Worker`` plus composed parts: a ``DPReducer`` over its DP group (``reducer.py``), a
``ShardedModel`` for the roles that hold a model (``sharded_model.py``), a ``Trainer`` for those that train it
(``training.py``), and its own dispatched methods.
"""

from .actor import ActorWorker
from .critic import CriticWorker
from .reducer import DPReducer
from .reference import ReferenceWorker
from .reward import RewardWorker
from .rollout import RolloutWorker
from .sharded_model import ShardedModel
from .training import Trainer

__all__ = ["ActorWorker", "CriticWorker", "DPReducer", "ReferenceWorker", "RewardWorker", "RolloutWorker", "ShardedModel", "Trainer"]
