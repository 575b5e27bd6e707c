"""``placement: auto``: plan a recipe config's roles onto the job's devices and write the plan back as a concrete
manual placement (pools, n_ranks, pp, tp, rollout.tp), validated like any config.
"""

from __future__ import annotations

import dataclasses
import os

from spmd_rlhf.config import FrameworkConfig, RoleConfig
from spmd_rlhf.config.dataflow import ROLE_KINDS, dataflow_of
from spmd_rlhf.mapping.calibrate import resolve_profile
from spmd_rlhf.mapping.devices import Cluster
from spmd_rlhf.mapping.profile import DeviceProfile
from spmd_rlhf.mapping.search import Mapping, Planner, PlanResult
from spmd_rlhf.mapping.workload import Batch, RoleSpec, lora_parameters, model_shape

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def config_dataflow(config: FrameworkConfig) -> tuple[list[RoleSpec], Batch]:
    """The model roles of ``config``'s algorithm (its declared dataflow; rule-based rewards and costs are not models),
    each with its own shape and batch sizes, and the step's batch."""
    specs = []
    for name, work in dataflow_of(config.algorithm.name).models_of(config).items():
        role, kind = getattr(config, name), ROLE_KINDS[name]
        if kind.worker == "rollout":
            # Asynchronous RL: TP replicas of the actor's model that generate, fed its weights.
            shape = model_shape(config.actor.model_path or config.model.path)
            specs.append(RoleSpec(name, shape, "lm", False, work, replica=True))
            continue
        shape = model_shape(role.model_path or config.model.path)
        # A generative judge is a causal LM whose pass writes verdicts: its weights count with the LM head, and its
        # pass is generation (``search.judge_seconds``).
        judge = getattr(role, "kind", None) == "generative"
        head = "lm" if judge else kind.head
        spec = RoleSpec(
            name,
            shape,
            head,
            kind.trained,
            work,
            judge_tokens=role.judge_max_new_tokens if judge else 0,
            sequence_parallel=getattr(role, "sequence_parallel", False),
        )
        lora = getattr(role, "lora", None)
        if kind.trained and lora is not None and lora.enabled:
            spec = dataclasses.replace(spec, lora_parameters=lora_parameters(shape, head, lora.modules, lora.rank_of))
        specs.append(_with_batch_sizes(spec, role))
    actor = config.actor
    batch = Batch(
        prompts=config.data.batch_size,
        samples=config.rollout.n,
        prompt_length=config.data.max_prompt_length,
        response_length=config.rollout.response_length,
        micro_batch_size=actor.micro_batch_size,
        mini_batch_size=actor.mini_batch_size,
        ppo_epochs=actor.ppo_epochs,
        dtype_bytes=_DTYPE_BYTES[config.model.dtype],
        activation_checkpointing=config.model.activation_checkpointing,
        checkpoint_policy=config.model.checkpoint_policy,
        memory_fraction=config.rollout.memory_fraction,
        keep_engine=config.rollout.keep_engine,
        max_staleness=config.algorithm.max_staleness,
    )
    return specs, batch


def _with_batch_sizes(spec: RoleSpec, role: RoleConfig) -> RoleSpec:
    """The role's own micro-batch (its forward one for frozen roles), mini-batch and bounds on what it keeps
    gathered."""
    micro = role.micro_batch_size if spec.trained else (role.forward_micro_batch_size or role.micro_batch_size)
    mini = getattr(role, "mini_batch_size", 0)
    budget = getattr(role, "unsharded_accumulation_mb", spec.unsharded_accumulation_mb)
    return dataclasses.replace(
        spec,
        micro_batch_size=micro,
        mini_batch_size=mini,
        unsharded_accumulation_mb=budget,
        forward_gather_mb=role.forward_gather_mb,
    )


def gpus_per_node(config: FrameworkConfig, world_size: int) -> int:
    """``mapping.gpus_per_node``, else torchrun's LOCAL_WORLD_SIZE, else the whole job on one node."""
    return config.mapping.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def plan_config(config: FrameworkConfig, world_size: int, *, profile: DeviceProfile | None = None) -> PlanResult:
    """Algorithm 1 for ``config``'s dataflow on ``world_size`` devices. With ``rollout.keep_engine`` and no mapping
    that holds the kept engine beside training, the mappings that release it after each generation (its mapping's
    ``keep_engine`` is then false, and ``mapping_overrides`` turns the key off)."""
    specs, batch = config_dataflow(config)
    cluster = Cluster(world_size, gpus_per_node(config, world_size), profile or resolve_profile(config.mapping.profile))
    try:
        return Planner(specs, cluster, batch).plan()
    except ValueError:
        if not batch.keep_engine:
            raise
        released = Planner(specs, cluster, dataclasses.replace(batch, keep_engine=False)).plan()
        return dataclasses.replace(released, engine_released=True)


def mapping_overrides(config: FrameworkConfig, mapping: Mapping) -> list[str]:
    """``mapping`` as config overrides for a manual placement: one pool per colocated set (``set0``, ``set1``, ...),
    each role's n_ranks, pp, tp, ep, cp and fsdp_size, and rollout.tp (the actor's generation layout, or the rollout
    role's replicas); rule-based scorers join the rollout role's pool, else the actor's."""
    overrides = ["placement=manual"]
    pool_of = {}
    for index, (roles, devices) in enumerate(zip(mapping.sets, mapping.devices)):
        for name in roles:
            pool_of[name] = (f"set{index}", devices)
    # A rule scorer runs beside the generation it scores: the rollout role's, else the actor's.
    beside = pool_of.get("rollout", pool_of["actor"])
    for name in config.enabled_roles():
        pool, devices = pool_of.get(name, beside)
        layout = mapping.layouts.get(name)
        if name == "rollout":  # asynchronous RL: the rollout role's replicas, rollout.tp wide each
            overrides += [f"rollout.pool={pool}", f"rollout.n_ranks={devices}", f"rollout.tp={layout.tp}"]
            continue
        pp, tp = (layout.pp, layout.tp) if layout else (1, 1)
        overrides += [
            f"{name}.pool={pool}",
            f"{name}.n_ranks={devices}",
            f"{name}.dp=0",
            f"{name}.pp={pp}",
            f"{name}.tp={tp}",
        ]
        if hasattr(getattr(config, name), "ep"):  # a role with a model (the rollout role generates with every expert)
            overrides += [f"{name}.ep={layout.ep if layout else 1}", f"{name}.cp={layout.cp if layout else 1}"]
            overrides.append(f"{name}.fsdp_size={layout.fsdp if layout else 0}")
    if "rollout" not in mapping.layouts:  # the actor generates: its generation layout's tp
        overrides.append(f"rollout.tp={mapping.layouts['actor'].tp_g}")
    if config.rollout.keep_engine and not mapping.keep_engine:
        overrides.append("rollout.keep_engine=false")  # the kept engine fits beside training nowhere (describe_plan)
    return overrides


def apply_mapping(config: FrameworkConfig, mapping: Mapping) -> FrameworkConfig:
    """``config`` with ``mapping`` written in (``mapping_overrides``), validated like any config."""
    from spmd_rlhf.config import with_overrides

    return with_overrides(config, mapping_overrides(config, mapping))


def describe_plan(result: PlanResult, *, devices: int, profile: DeviceProfile) -> str:
    """The plan as text: the chosen mapping with per-role layouts and stage times, then the runners-up."""
    best = result.best
    lines = [
        f"# device mapping for {devices} devices ({profile.name}, {profile.source})",
        f"placement: {best.describe()}",
        f"{'role':<12} {'devices':>7}  layout",
    ]
    for roles, count in zip(best.sets, best.devices):
        for name in roles:
            lines.append(f"{name:<12} {count:>7}  {best.layouts[name]}")
    stages = "  ".join(f"{stage} {seconds:.3g} s" for stage, seconds in best.stage_seconds.items())
    overlap = " with the next batch's generation overlapping training" if best.overlapped_seconds is not None else ""
    lines.append(f"estimated step: {best.seconds:.3g} s{overlap} ({stages})")
    if result.engine_released:
        lines.append(
            "the actor's engine (generation copy, KV cache, CUDA graphs) is released after each generation: kept, it "
            "fits beside training in no mapping (rollout.keep_engine=false)"
        )
    lines += ["", "# runners-up"]
    for mapping in result.runners_up:
        lines.append(
            f"{mapping.seconds:10.3g} s  {mapping.describe()}  "
            + ", ".join(f"{name}: {layout}" for name, layout in mapping.layouts.items())
        )
    lines.append(f"\n{result.mappings_evaluated} mappings evaluated in {result.search_seconds:.2f} s")
    return "\n".join(lines) + "\n"
