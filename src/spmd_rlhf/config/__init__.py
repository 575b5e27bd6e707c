"""The configuration: typed dataclass sections with a docstring per field, validated in ``__post_init__``
(``model``, ``roles``, ``rollout``, ``algorithm``, ``run``), the whole config (``framework``) and its cross-section
checks (``checks``), the declared dataflow of each algorithm family (``dataflow``), and the loader (YAML + ``key=value``
overrides). The bottom of the house: it imports nothing else of the package, and no torch.
"""

from spmd_rlhf.config.algorithm import ALGORITHMS, LOSS_AGGREGATIONS, AlgorithmConfig
from spmd_rlhf.config.choices import (
    ATTENTION_BACKENDS,
    CP_ATTENTION,
    DEFAULT_KV_BLOCK_SIZE,
    DEVICE_SETTINGS,
    ENVIRONMENTS,
    LORA_TARGETS,
    PARTIAL_ROLLOUTS,
    PLACEMENTS,
)
from spmd_rlhf.config.dataflow import GROUP_ALGORITHMS, ROLE_KINDS, ROLES
from spmd_rlhf.config.errors import ConfigError, format_value
from spmd_rlhf.config.framework import FrameworkConfig
from spmd_rlhf.config.loader import config_reference, field_docs, load_config, to_yaml, with_overrides
from spmd_rlhf.config.model import ModelConfig
from spmd_rlhf.config.roles import LoRAConfig, RoleConfig, ScoringRoleConfig, TrainableRoleConfig
from spmd_rlhf.config.rollout import RolloutConfig
from spmd_rlhf.config.run import DataConfig, MappingConfig, TrainerConfig
