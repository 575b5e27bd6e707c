"""The whole configuration: one field per section, the roles a run enables and the pools they form. Its
``__post_init__`` runs the cross-section checks (``config.checks``), after each section has checked its own fields.
"""

from dataclasses import dataclass, field

from spmd_rlhf.config.algorithm import AlgorithmConfig
from spmd_rlhf.config.checks import check_framework
from spmd_rlhf.config.dataflow import PIPELINE_SCORERS, ROLE_KINDS, ROLES
from spmd_rlhf.config.derive import derive
from spmd_rlhf.config.model import ModelConfig
from spmd_rlhf.config.roles import RoleConfig, ScoringRoleConfig, TrainableRoleConfig
from spmd_rlhf.config.rollout import RolloutConfig
from spmd_rlhf.config.run import DataConfig, MappingConfig, TrainerConfig


@dataclass
class FrameworkConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model and how every model runs."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets and batching."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm and its loss and advantage settings."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Response generation: sampling and the engine; with rollout.enabled, the rollout role that generates on ranks
    of its own (asynchronous RL)."""
    placement: str | None = None
    """Roles on devices: colocate (one pool), split (actor+reference | rest; with a rollout role, the rest | rollout and
    reward), standalone, manual (by pool), or auto (the device mapper picks the pools and every role's pp/tp and
    rollout.tp; see mapping). null: split with a rollout role (rollout.enabled), else colocate."""
    mapping: MappingConfig = field(default_factory=MappingConfig)
    """How placement=auto models the devices."""
    actor: TrainableRoleConfig = field(default_factory=TrainableRoleConfig)
    """The policy being trained; it also generates the rollouts."""
    critic: TrainableRoleConfig = field(default_factory=lambda: TrainableRoleConfig(lr=1e-4))
    """Value model trained alongside the actor (ppo, safe_rlhf)."""
    reference: RoleConfig = field(default_factory=RoleConfig)
    """Frozen copy of the initial policy for the KL term."""
    reward: ScoringRoleConfig = field(default_factory=ScoringRoleConfig)
    """Scores each response: a rule function or a reward model."""
    cost: ScoringRoleConfig = field(default_factory=lambda: ScoringRoleConfig(kind="model"))
    """Safe-RLHF cost model: scores how harmful each response is (safe_rlhf only)."""
    cost_critic: TrainableRoleConfig = field(default_factory=lambda: TrainableRoleConfig(lr=1e-4))
    """Safe-RLHF cost value model, trained on the cost returns beside the reward critic (safe_rlhf only)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Step count, checkpoints, logging and the run's directory."""

    def __post_init__(self) -> None:
        self.derived = derive(self)
        """Key -> (value, why) for every key left null whose value followed from the others (``config.derive``)."""
        check_framework(self)

    def enabled_roles(self) -> dict[str, RoleConfig]:
        """The roles this run creates, by name, in ``ROLES`` order."""
        return {name: getattr(self, name) for name in ROLES if getattr(self, name).enabled}

    def resource_pools(self) -> dict[str, list[str]]:
        """Pool name -> the enabled roles placed on it; empty for placement=auto, where the device mapper decides."""
        roles = list(self.enabled_roles())
        match self.placement:
            case "colocate":
                return {"all": roles}
            case "split":
                if "rollout" in roles:
                    # Asynchronous RL: the rollout generates beside the reward that scores each batch behind it; every
                    # role the step itself calls goes on the other pool, where its calls do not queue behind the next
                    # batch's generation.
                    scoring = [name for name in roles if name == "rollout" or name in PIPELINE_SCORERS]
                    return {"policy": [name for name in roles if name not in scoring], "scoring": scoring}
                # The policy models (actor, reference) on one pool, the models that score them on the other.
                policy = [name for name in roles if ROLE_KINDS[name].head == "lm"]
                return {"policy": policy, "scoring": [name for name in roles if name not in policy]}
            case "standalone":
                return {name: [name] for name in roles}
            case "manual":
                pools: dict[str, list[str]] = {}
                for name in roles:
                    pools.setdefault(getattr(self, name).pool, []).append(name)
                return pools
        return {}
