"""Algorithm 1 of HybridFlow (Sheng et al. 2024): the cheapest mapping of an RLHF dataflow's roles onto devices.

    for each placement (the roles grouped into colocated sets):
        for each allocation of the devices to the sets (each set at least its minimal allocation):
            for each role: auto_parallel picks its layout on its set's devices (fastest that fits in memory)
            d_cost = Σ over stages of max over sets of Σ latencies of the set's roles in that stage
    keep the cheapest

Roles in one set share its devices and run one after another; different sets run at the same time (on a CPU
profile with ``shared_cores``, sets busy in the same stage share the machine's cores). A set's devices
are a whole number of nodes once the cluster has more than one node (``Cluster.gpus_per_node``), any number below.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from spmd_rlhf.config.dataflow import PIPELINE_SCORERS
from spmd_rlhf.mapping.cost import generation_seconds, held_bytes, pass_seconds, resident_bytes, working_bytes
from spmd_rlhf.mapping.devices import Cluster, Layout
from spmd_rlhf.mapping.workload import STAGES, Batch, RoleSpec


@dataclass(frozen=True)
class Mapping:
    """Roles on devices: colocated sets, the devices of each, every role's layout and the simulated step."""

    sets: tuple[tuple[str, ...], ...]
    devices: tuple[int, ...]
    """Devices of each set, in ``sets`` order."""
    layouts: dict[str, Layout] = field(compare=False)
    stage_seconds: dict[str, float] = field(compare=False)
    """Simulated seconds of each stage (the slowest set's)."""
    keep_engine: bool = field(default=False, compare=False)
    """Whether the actor's engine stays between generations in this mapping (``Batch.keep_engine``)."""
    overlapped_seconds: float | None = field(default=None, compare=False)
    """With a rollout role generating ahead (``Batch.max_staleness`` >= 1): the step time, where generation overlaps
    training (``Planner.evaluate``); None: the stages run one after another."""

    @property
    def seconds(self) -> float:
        """d_cost: the simulated step time."""
        if self.overlapped_seconds is not None:
            return self.overlapped_seconds
        return sum(self.stage_seconds.values())

    def describe(self) -> str:
        """``[actor,reference]:4 [critic]:4`` — sets and their devices."""
        return " ".join(f"[{','.join(roles)}]:{devices}" for roles, devices in zip(self.sets, self.devices))


@dataclass
class PlanResult:
    best: Mapping
    runners_up: list[Mapping]
    """The next cheapest mappings, cheapest first."""
    mappings_evaluated: int
    search_seconds: float
    engine_released: bool = False
    """Set by ``placement.plan_config`` when no mapping held ``rollout.keep_engine``'s kept engine beside training
    and these mappings release it after each generation instead."""


def placements(names: list[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every grouping of ``names`` into non-empty colocated sets (set partitions; a Bell number of them), each set
    in ``names`` order and the sets ordered by their first role."""
    if not names:
        yield ()
        return
    first, rest = names[0], names[1:]
    for partition in placements(rest):
        yield ((first,),) + partition
        for index in range(len(partition)):
            yield partition[:index] + ((first,) + partition[index],) + partition[index + 1 :]


def allocations(total: int, minimum: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to split ``total`` units over the sets with at least ``minimum[i]`` units for set i."""
    if len(minimum) == 1:
        if total >= minimum[0]:
            yield (total,)
        return
    for first in range(minimum[0], total - sum(minimum[1:]) + 1):
        for rest in allocations(total - first, minimum[1:]):
            yield (first,) + rest


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(role: RoleSpec, devices: int, cluster: Cluster, batch: Batch) -> list[Layout]:
    """Every (pp, dp, tp[, tp_g], ep, cp) the framework can run the role with on ``devices`` devices: tp within a
    node and dividing heads, KV heads, MLP width and (LM head) vocabulary; pp at most the layers and 1 for a tied LM
    head; dp dividing the step's rows (each DP rank takes an equal share) and, for trained roles, the mini-batch in
    whole micro-batches; tp_g dividing tp; ep (an MoE model's) dividing dp and the expert count; cp (not for a
    generative judge) dividing dp: Ulysses where it divides each rank's heads, ring elsewhere
    (``cost.ring_context_parallel``); and HSDP (``_hybrid_shard_groups``: within a node where FSDP over all of dp
    would cross nodes, and a frozen role replicated; not for a generative judge, which FSDP does not shard)."""
    shape = role.shape
    sizes = [shape.heads, shape.kv_heads, shape.intermediate] + ([shape.vocab] if role.head == "lm" else [])
    if shape.experts:  # tensor parallelism splits each expert's width too (and a shared expert's)
        sizes += [shape.expert_intermediate] + (
            [shape.shared_expert_intermediate] * bool(shape.shared_expert_intermediate)
        )
    micro = role.micro_batch_size or batch.micro_batch_size
    mini = role.mini_batch_size or batch.mini_batch_size or batch.rows
    generates = any("generate" in work for work in role.work.values())
    layouts = []
    for tp in _divisors(devices):
        if tp > cluster.gpus_per_node or any(size % tp for size in sizes):
            continue
        if role.replica:  # a rollout role: TP replicas on every DP rank, generating with their own tp
            if batch.rows % (devices // tp) == 0:
                layouts.append(Layout(pp=1, dp=devices // tp, tp=tp, tp_g=tp))
            continue
        for pp in _divisors(devices // tp):
            if pp > shape.layers or (pp > 1 and role.head == "lm" and shape.tied) or (pp > 1 and role.judge_tokens):
                continue
            dp = devices // (tp * pp)
            if batch.rows % dp or (role.trained and mini % (micro * dp)):
                continue
            eps = [ep for ep in _divisors(dp) if shape.experts % ep == 0] if shape.experts else [1]
            context_parallel = not role.judge_tokens
            cps = _divisors(dp) if context_parallel else [1]
            fsdps = [0] if role.judge_tokens else [0, *_hybrid_shard_groups(role, dp, tp, cluster)]
            for tp_g, ep, cp, fsdp in itertools.product(_divisors(tp) if generates else [0], eps, cps, fsdps):
                layouts.append(Layout(pp=pp, dp=dp, tp=tp, tp_g=tp_g, ep=ep, cp=cp, fsdp=fsdp))
    return layouts


def _hybrid_shard_groups(role: RoleSpec, dp: int, tp: int, cluster: Cluster) -> list[int]:
    """HSDP's candidate shard groups (``<role>.fsdp_size``): where FSDP over all of dp would cross nodes, the most DP
    ranks (dividing dp) whose TP ranks fit one node, so FSDP's collectives stay on its links; and for a frozen role
    at dp > 1, 1: every DP rank holds its weights whole (in the compute dtype), so its forward gathers nothing."""
    groups = []
    if cluster.spans_nodes(dp * tp):
        groups.append(max(size for size in _divisors(dp) if size * tp <= cluster.gpus_per_node))
    if not role.trained and dp > 1 and 1 not in groups:
        groups.append(1)
    return groups


def role_stage_seconds(
    role: RoleSpec, layout: Layout, cluster: Cluster, batch: Batch, *, free_bytes: float
) -> dict[str, float]:
    """Simulated seconds of the role's work in each stage on ``layout`` (inf where it does not fit)."""
    seconds = {}
    for stage, work in role.work.items():
        total = 0.0
        for kind in work:
            if kind in ("generate", "greedy"):
                rows = batch.rows if kind == "generate" else batch.prompts
                total += generation_seconds(
                    role, layout, cluster, batch, rows=rows, free_bytes=free_bytes, reshard=not role.replica
                )
            elif kind == "forward" and role.judge_tokens:
                total += judge_seconds(role, layout, cluster, batch, free_bytes=free_bytes)
            else:
                total += pass_seconds(role, layout, cluster, batch, train=kind == "train")
        seconds[stage] = total
    return seconds


def judge_seconds(role: RoleSpec, layout: Layout, cluster: Cluster, batch: Batch, *, free_bytes: float) -> float:
    """Simulated seconds of a generative judge's verdicts: each DP rank a replica TP-sharded over the layout's tp (no
    reshard), prefilling every row's prompt and response and writing up to ``role.judge_tokens`` tokens (the
    template's own text not counted)."""
    verdicts = replace(batch, prompt_length=batch.sequence_length, response_length=role.judge_tokens)
    replicas = replace(layout, tp_g=layout.tp)
    return generation_seconds(role, replicas, cluster, verdicts, rows=batch.rows, free_bytes=free_bytes, reshard=False)


class Planner:
    """Algorithm 1 for one dataflow, cluster and batch; ``auto_parallel`` results are cached per (role, devices,
    colocated set), so the allocation loop only adds up cached latencies."""

    def __init__(self, roles: list[RoleSpec], cluster: Cluster, batch: Batch) -> None:
        if not roles:
            raise ValueError("nothing to place: the dataflow has no model roles")
        self.roles = {role.name: role for role in roles}
        self.cluster = cluster
        self.batch = batch
        gpus_per_node = cluster.gpus_per_node
        if cluster.devices > gpus_per_node and cluster.devices % gpus_per_node:
            raise ValueError(
                f"{cluster.devices} devices are not whole nodes of {gpus_per_node}; give the job's device count and "
                f"its devices per node (--gpus-per-node)"
            )
        self.unit = gpus_per_node if cluster.devices > gpus_per_node else 1
        """Devices per allocation step: whole nodes on a multi-node cluster."""
        self.budget = cluster.profile.device_memory * batch.memory_fraction
        self._cache: dict[tuple[str, int, tuple[str, ...]], tuple[Layout, dict[str, float]] | None] = {}

    def auto_parallel(
        self, name: str, devices: int, colocated: tuple[str, ...], *, hybrid: bool = True
    ) -> tuple[Layout, dict[str, float]] | None:
        """The role's fastest layout on ``devices`` devices shared with ``colocated`` (itself included) and its
        seconds per stage, or None if no layout fits in memory; ``hybrid=False``: among the layouts without HSDP."""
        key = (name, devices, colocated, hybrid)
        if key not in self._cache:
            self._cache[key] = self._auto_parallel(self.roles[name], devices, colocated, hybrid=hybrid)
        return self._cache[key]

    def _auto_parallel(
        self, role: RoleSpec, devices: int, colocated: tuple[str, ...], *, hybrid: bool
    ) -> tuple[Layout, dict[str, float]] | None:
        free = self.free_bytes(devices, colocated)
        best = None
        for layout in candidate_layouts(role, devices, self.cluster, self.batch):
            if not hybrid and layout.fsdp_replicas > 1:
                continue
            # A kept engine's generation copy and KV cache, a judge's replica, sit beside the role's own passes.
            held = held_bytes(role, layout, self.batch, free_bytes=free)
            if working_bytes(role, layout, self.batch) + held > free:
                continue
            seconds = role_stage_seconds(role, layout, self.cluster, self.batch, free_bytes=free)
            total = sum(seconds.values())
            if math.isfinite(total) and (best is None or total < best[0]):
                best = (total, layout, seconds)
        return None if best is None else (best[1], best[2])

    def free_bytes(self, devices: int, colocated: tuple[str, ...]) -> float:
        """What each of ``devices`` devices has for passes once every role of ``colocated`` holds its resident state."""
        return self.budget - sum(resident_bytes(self.roles[name], devices, self.batch) for name in colocated)

    def minimal_units(self, colocated: tuple[str, ...]) -> int | None:
        """The fewest allocation units on which every role of the set fits, or None if none does."""
        for units in range(1, self.cluster.devices // self.unit + 1):
            if all(self.auto_parallel(name, units * self.unit, colocated) for name in colocated):
                return units
        return None

    def _set_layouts(
        self, colocated: tuple[str, ...], count: int, *, hybrid: bool
    ) -> tuple[dict[str, Layout], dict[str, float]] | None:
        """Each role of a colocated set on its ``count`` devices at its ``auto_parallel`` layout, and the set's seconds
        per stage; None where a role fits nowhere or the layouts do not fit together."""
        layouts, set_seconds = {}, dict.fromkeys(STAGES, 0.0)
        for name in colocated:
            chosen = self.auto_parallel(name, count, colocated, hybrid=hybrid)
            if chosen is None:
                return None
            layouts[name] = chosen[0]
            for stage, seconds in chosen[1].items():
                set_seconds[stage] += seconds
        # Each layout was chosen alone; what a role of the set holds by its layout (a kept engine, a judge's replica,
        # HSDP's replicated state) also stays through the other roles' passes.
        free = self.free_bytes(count, colocated)
        held = sum(held_bytes(self.roles[name], layouts[name], self.batch, free_bytes=free) for name in colocated)
        if any(working_bytes(self.roles[name], layouts[name], self.batch) + held > free for name in colocated):
            return None
        return layouts, set_seconds

    def evaluate(self, sets: tuple[tuple[str, ...], ...], devices: tuple[int, ...]) -> Mapping | None:
        """d_cost of one placement and allocation with auto_parallel layouts; None if a role does not fit."""
        layouts, stage_seconds = {}, {}
        per_set = []
        for colocated, count in zip(sets, devices):
            # Each role's HSDP layout holds a replica's state; chosen alone, several may not fit together: then the
            # set's roles take their fastest layouts without it.
            chosen = self._set_layouts(colocated, count, hybrid=True) or self._set_layouts(
                colocated, count, hybrid=False
            )
            if chosen is None:
                return None
            set_layouts, set_seconds = chosen
            layouts.update(set_layouts)
            per_set.append(set_seconds)
        cores = self.cluster.profile.shared_cores
        for stage in STAGES:
            stage_seconds[stage] = max(seconds[stage] for seconds in per_set)
            if cores:  # CPU ranks sharing cores: the sets busy in this stage slow each other down
                busy = sum(count for seconds, count in zip(per_set, devices) if seconds[stage] > 0)
                stage_seconds[stage] *= max(1.0, busy / cores)
        overlapped = None
        rollout = [index for index, colocated in enumerate(sets) if any(self.roles[n].replica for n in colocated)]
        if rollout:
            # Asynchronous RL: the actor sends its weights to the rollout role every step; from max_staleness 1 on,
            # the rollout set generates (and scores) the next batch while the other sets prepare and train this one.
            stage_seconds["weight_sync"] = self.weight_sync_seconds()
            if self.batch.max_staleness >= 1:
                rollout_seconds = sum(per_set[rollout[0]].values())
                others = [seconds for index, seconds in enumerate(per_set) if index not in rollout]
                training = sum(max((seconds[stage] for seconds in others), default=0.0) for stage in STAGES)
                overlapped = max(rollout_seconds, training) + stage_seconds["weight_sync"]
        return Mapping(
            sets=sets,
            devices=devices,
            layouts=layouts,
            stage_seconds=stage_seconds,
            keep_engine=self.batch.keep_engine,
            overlapped_seconds=overlapped,
        )

    def weight_sync_seconds(self) -> float:
        """The actor's weights (the rollout's dtype) broadcast to the rollout role: across nodes on a multi-node
        cluster (the roles never share devices)."""
        replica = next(role for role in self.roles.values() if role.replica)
        weights = replica.shape.parameters(replica.head) * self.batch.dtype_bytes
        bandwidth = self.cluster.profile.link_bandwidth(across_nodes=self.cluster.devices > self.cluster.gpus_per_node)
        return weights / bandwidth + self.cluster.profile.collective_latency

    def _stalls_the_pipeline(self, colocated: tuple[str, ...]) -> bool:
        """Whether a rollout role shares these devices with a role the step itself calls: that call would wait
        behind the next batch's generation, issued before it (a role runs its calls in issue order). Only the reward,
        which the rollout pipeline scores each batch with right behind its generation, may sit beside it."""
        roles = [self.roles[name] for name in colocated]
        return any(role.replica for role in roles) and any(
            not role.replica and role.name not in PIPELINE_SCORERS for role in roles
        )

    def mappings(self) -> Iterator[Mapping]:
        """Every feasible mapping (placement x allocation) with its auto_parallel layouts."""
        units = self.cluster.devices // self.unit
        for sets in placements(list(self.roles)):
            if any(self._stalls_the_pipeline(colocated) for colocated in sets):
                continue
            minimum = [self.minimal_units(colocated) for colocated in sets]
            if None in minimum:
                continue
            for allocation in allocations(units, minimum):
                mapping = self.evaluate(sets, tuple(count * self.unit for count in allocation))
                if mapping is not None:
                    yield mapping

    def plan(self, *, runners_up: int = 5) -> PlanResult:
        """The cheapest mapping and the next ``runners_up`` (ties go to fewer sets: less to manage)."""
        started = time.perf_counter()
        counter = itertools.count()
        evaluated = 0
        heap: list[tuple[float, int, int, Mapping]] = []
        for mapping in self.mappings():
            evaluated += 1
            entry = (-mapping.seconds, -len(mapping.sets), -next(counter), mapping)
            if len(heap) <= runners_up:
                heapq.heappush(heap, entry)
            else:
                heapq.heappushpop(heap, entry)
        if not heap:
            raise ValueError(
                f"no mapping fits: the roles do not fit in {self.cluster.devices} devices of "
                f"{self.cluster.profile.device_memory / 2**30:.0f} GiB ({self.cluster.profile.name}); "
                "use more devices, smaller micro-batches, activation checkpointing or shorter sequences"
                + (
                    ", or rollout.keep_engine=false (the kept generation copy and KV cache take memory through "
                    "training)"
                    if self.batch.keep_engine
                    else ""
                )
            )
        ranked = [entry[3] for entry in sorted(heap, reverse=True)]
        return PlanResult(
            best=ranked[0],
            runners_up=ranked[1:],
            mappings_evaluated=evaluated,
            search_seconds=time.perf_counter() - started,
        )
