"""Where each role runs: the one place that turns a config and a world size into each enabled role's pool of ranks and
its ``ParallelDims``. The recipes' setup and their dry run both go through ``place_roles``.

    placement = place_roles(config, world_size)      # placement.config has placement=auto resolved
    for name, (pool, dims) in placement.roles.items(): ...
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rlhf.config import FrameworkConfig
from spmd_rlhf.mapping.calibrate import resolve_profile
from spmd_rlhf.mapping.placement import apply_mapping, describe_plan, plan_config
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.runtime.layout import ResourcePool


@dataclass(frozen=True)
class Placement:
    config: FrameworkConfig
    """The config with placement=auto replaced by the mapper's manual placement (else the config as given)."""
    roles: dict[str, tuple[ResourcePool, ParallelDims]]
    """Each enabled role's pool and layout, in the config's pool order."""
    plan: str
    """The mapper's plan as text, '' when placement was not auto."""


def place_roles(config: FrameworkConfig, world_size: int) -> Placement:
    """Resolve ``placement=auto``, cut the world into pools and give each role its layout (one error naming the key
    to change for any size that does not fit)."""
    config, plan = resolve_placement(config, world_size)
    roles = {}
    for name, pool in role_pools(config, world_size).items():
        role = getattr(config, name)
        roles[name] = (
            pool,
            # A rollout role has no ep or cp: it generates, with every expert.
            ParallelDims.for_ranks(
                len(pool),
                pp=role.pp,
                tp=role.tp,
                dp=role.dp,
                ep=getattr(role, "ep", 1),
                cp=getattr(role, "cp", 1),
                fsdp_size=getattr(role, "fsdp_size", 0),
                role=name,
            ),
        )
    return Placement(config, roles, plan)


def resolve_placement(config: FrameworkConfig, world_size: int) -> tuple[FrameworkConfig, str]:
    """``config`` itself, or for placement=auto the device mapper's plan written in as a manual placement (pools,
    n_ranks, pp, tp, rollout.tp); and the plan as text ('' when there is none)."""
    if config.placement != "auto":
        return config, ""
    profile = resolve_profile(config.mapping.profile)
    result = plan_config(config, world_size, profile=profile)
    return apply_mapping(config, result.best), describe_plan(result, devices=world_size, profile=profile)


def role_pools(config: FrameworkConfig, world_size: int) -> dict[str, ResourcePool]:
    """The ranks of each enabled role under ``config.placement``; pools take consecutive ranks in order."""
    pools = config.resource_pools()
    if not pools:
        raise ValueError(
            f"placement={config.placement}: resolve it first (resolve_placement) to get the mapper's pools"
        )
    sizes = {}
    for pool, roles in pools.items():
        sizes[pool] = max(getattr(config, role).n_ranks for role in roles)
    unsized = [pool for pool, size in sizes.items() if size == 0]
    free = world_size - sum(sizes.values())
    if unsized:
        if free < len(unsized) or free % len(unsized):
            raise ValueError(
                f"placement={config.placement}: {free} ranks left for pools {unsized} of a {world_size}-rank job; "
                f"set the roles' n_ranks or launch a multiple of {len(unsized)} ranks"
            )
        for pool in unsized:
            sizes[pool] = free // len(unsized)
    if sum(sizes.values()) != world_size:
        raise ValueError(
            f"placement={config.placement}: pools need {sum(sizes.values())} ranks but the job has {world_size}"
        )
    result, start = {}, 0
    for pool, roles in pools.items():
        for role in roles:
            result[role] = ResourcePool(range(start, start + sizes[pool]))
        start += sizes[pool]
    return result
