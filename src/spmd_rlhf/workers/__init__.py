"""Role workers, one file per role: actor, critic, reference, reward (rule or model; also the cost role)."""

from .actor import ActorWorker
from .critic import CriticWorker
from .reference import ReferenceWorker
from .reward import RewardWorker

__all__ = ["ActorWorker", "CriticWorker", "ReferenceWorker", "RewardWorker"]
