"""Auto device mapping (HybridFlow's Algorithm 1): place an RLHF dataflow's roles on devices and choose each role's
parallel layout, by simulating each candidate's step time with an analytical cost model.

- ``workload``: model shapes (by size name or config), the step's batch, each algorithm's roles and stages.
- ``profile`` / ``calibrate``: what a device can do (built-in datasheet profiles; ``spmd-rlhf calibrate`` measures).
- ``cost``: seconds and bytes of a role's work on a layout.
- ``search``: placements, allocations, auto_parallel, d_cost, the plan.
- ``placement``: ``placement: auto`` for recipe configs; ``commands``: ``spmd-rlhf plan`` and ``calibrate``.
"""

from spmd_rlhf.mapping.calibrate import resolve_profile
from spmd_rlhf.mapping.devices import Cluster, Layout
from spmd_rlhf.mapping.placement import apply_mapping, mapping_overrides, plan_config
from spmd_rlhf.mapping.profile import BUILTIN_PROFILES, DeviceProfile, load_profile
from spmd_rlhf.mapping.search import Mapping, Planner, PlanResult
from spmd_rlhf.mapping.workload import NAMED_SHAPES, Batch, ModelShape, RoleSpec, dataflow, model_shape

__all__ = [
    "BUILTIN_PROFILES",
    "NAMED_SHAPES",
    "Batch",
    "Cluster",
    "DeviceProfile",
    "Layout",
    "Mapping",
    "ModelShape",
    "PlanResult",
    "Planner",
    "RoleSpec",
    "apply_mapping",
    "dataflow",
    "load_profile",
    "mapping_overrides",
    "model_shape",
    "plan_config",
    "resolve_profile",
]
