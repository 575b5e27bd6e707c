"""What a recipe would run, without running it: the resolved config, the placement, each role's layout and a
memory estimate per rank (``<recipe>.py --dry-run --world-size N``; no torchrun, no process group).

The memory estimate is the device mapper's (``spmd_rlhf.mapping.cost``): weights and optimizer state, which dominate
at scale and are exact given the layout. A trained role keeps float32 weights, float32 gradients and two Adam moments
(``TRAINING_BYTES_PER_PARAMETER``), sharded over all its ranks (FSDP over dp, TP over tp, PP over pp); a frozen role
keeps its weights in ``model.dtype``. While generating, each actor rank (each rollout rank, with a rollout role) holds
its generation shard (the weights in ``model.dtype`` split ``rollout.tp`` ways) and its KV cache (sized here for the
batch at full length), with ``rollout.keep_engine`` (the default) from its first generation to the end of the run,
through every training pass. In a training or forward pass it also holds that pass's working set (``working_bytes``: one
micro-batch's activations, its logits at the response positions and the log-prob path's float32 vocabulary chunks); the
largest of its roles' is shown. A generative judge (``reward.kind=generative``) holds a whole TP-sharded replica per DP
rank and, while judging, the KV cache of its DP shard's prompts, responses and verdicts. The engine's working buffers
and FSDP's gathered blocks (one block at a time) are not counted.
"""

from __future__ import annotations

from spmd_rlhf.config import FrameworkConfig, ScoringRoleConfig, to_yaml
from spmd_rlhf.config.dataflow import dataflow_of
from spmd_rlhf.mapping.cost import replicated_bytes, resident_bytes, working_bytes
from spmd_rlhf.mapping.devices import Layout
from spmd_rlhf.mapping.placement import config_dataflow
from spmd_rlhf.mapping.role_pools import place_roles
from spmd_rlhf.mapping.workload import Batch, RoleSpec
from spmd_rlhf.models.expert_parallel import check_expert_parallel
from spmd_rlhf.parallel_dims import ParallelDims
from spmd_rlhf.tiny import ensure_tiny_assets

LAYOUT_COLUMNS = {"pp": "pp", "dp": "dp", "tp": "tp", "ep": "ep", "cp": "cp", "fsdp": "fsdp_shards"}
"""The table's layout columns and the ``ParallelDims`` attribute each shows (fsdp: the DP ranks FSDP shards over)."""


def _layout(dims: ParallelDims | None) -> str:
    """A role's parallel sizes as the table's columns (blank for a role without a model)."""
    return "".join(f" {getattr(dims, name) if dims is not None else '':>4}" for name in LAYOUT_COLUMNS.values())


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def describe(config: FrameworkConfig, world_size: int) -> str:
    """The dry-run report: resolved config, pools, each role's layout and per-rank state, per-rank totals."""
    ensure_tiny_assets(config)
    placement = place_roles(config, world_size)
    config, plan = placement.config, placement.plan
    specs, batch = config_dataflow(config)
    models = {spec.name: spec for spec in specs}
    lines = ["# resolved config", to_yaml(config).rstrip(), ""]
    if plan:
        lines += [plan.rstrip(), ""]
    lines.append(f"# placement: {config.placement}, world size {world_size}")
    header = "".join(f" {name:>4}" for name in LAYOUT_COLUMNS)
    lines.append(f"{'role':<12} {'ranks':<10}{header} {'parameters':>14}  per-rank state")
    per_rank = [0.0] * world_size
    largest_pass = [0.0] * world_size
    for name in dataflow_of(config.algorithm.name).roles_of(config):
        (pool, dims), role = placement.roles[name], getattr(config, name)
        if name == "rollout":  # counted below with generation: its shard and KV cache
            count = models["actor"].shape.parameters("lm")
            lines.append(
                f"{name:<12} {_ranks(pool.ranks):<10}{_layout(dims)} {count:>14,}  "
                f"generation shard + KV cache only (the actor's weights, {config.model.dtype})"
            )
            continue
        if name not in models:  # a rule or remote reward or cost: no model
            what = f"{name}.url={role.url}" if role.kind == "remote" else f"{name}.rule={role.rule}"
            lines.append(f"{name:<12} {_ranks(pool.ranks):<10}{_layout(None)} {role.kind:>14}  none ({what})")
            continue
        spec = models[name]
        check_expert_parallel(spec.shape.experts or None, dims.ep, key=f"{name}.ep")  # as the real run would
        count = spec.shape.parameters(spec.head)
        if getattr(role, "kind", None) == "generative":
            state, working = _judge_bytes(role, spec, batch, dp=dims.dp, tp=dims.tp)
            what = (
                f"a judge replica per DP rank, {config.model.dtype}; + {_mib(working)} KV cache while it writes up "
                f"to {role.judge_max_new_tokens} tokens per response"
            )
        else:
            layout = Layout(pp=dims.pp, dp=dims.dp, tp=dims.tp, cp=dims.cp, ep=dims.ep, fsdp=dims.fsdp_size)
            state = resident_bytes(spec, len(pool), batch) + replicated_bytes(spec, layout, batch)  # HSDP's replicas
            what = "weights + grads + Adam, float32" if spec.trained else f"weights, {config.model.dtype}"
            if spec.lora_parameters:
                what = f"base weights, {config.model.dtype}; {spec.lora_parameters:,} LoRA parameters + grads + Adam"
            working = working_bytes(spec, layout, batch)
        lines.append(f"{name:<12} {_ranks(pool.ranks):<10}{_layout(dims)} {count:>14,}  {_mib(state)} ({what})")
        for rank in pool.ranks:
            per_rank[rank] += state
            largest_pass[rank] = max(largest_pass[rank], working)
    # The rollout role generates on its own ranks when there is one; the actor on its own otherwise.
    generating = placement.roles["rollout" if "rollout" in placement.roles else "actor"][0].ranks
    generation = _generation_bytes(config, models["actor"], batch, len(generating))
    lines += ["", "# memory per rank (weights and optimizer state, plus what generation or the largest pass adds)"]
    # A kept engine (rollout.keep_engine) holds the shard and KV cache from the first generation on; the KV cache
    # here is the batch's at full length, what a cache sized from free memory stops at.
    when = "from the first generation on (rollout.keep_engine)" if config.rollout.keep_engine else "while generating"
    for rank, state in enumerate(per_rank):
        extra = f" + {_mib(generation)} {when}" if rank in generating else ""
        lines.append(f"rank {rank}: {_mib(state)}{extra} + {_mib(largest_pass[rank])} in its largest pass")
    return "\n".join(lines) + "\n"


def _generation_bytes(config: FrameworkConfig, actor: RoleSpec, batch: Batch, generating_ranks: int) -> float:
    """One generating rank's generation shard plus its KV cache with its replica's share of the batch at full
    length (``generating_ranks``: the actor's, or the rollout role's)."""
    tp = config.rollout.tp
    shard = actor.shape.parameters("lm") * batch.dtype_bytes / tp
    rows = -(-batch.prompts * batch.samples // (generating_ranks // tp))
    tokens = rows * (batch.prompt_length + batch.response_length)
    return shard + tokens * actor.shape.kv_bytes_per_token(batch.dtype_bytes) / tp


def _judge_bytes(role: ScoringRoleConfig, spec: RoleSpec, batch: Batch, *, dp: int, tp: int) -> tuple[float, float]:
    """A generative judge's weights on one rank (its TP shard of a whole replica: the judge is not FSDP-sharded) and
    its KV cache with its DP shard's requests at full length (prompt, response and verdict; the template's own
    text not counted)."""
    weights = spec.shape.parameters("lm") * batch.dtype_bytes / tp
    rows = -(-batch.prompts * batch.samples // dp)
    tokens = rows * (batch.prompt_length + batch.response_length + role.judge_max_new_tokens)
    return weights, tokens * spec.shape.kv_bytes_per_token(batch.dtype_bytes) / tp


def _ranks(ranks: tuple[int, ...]) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1
        else ",".join(map(str, ranks))
    )
