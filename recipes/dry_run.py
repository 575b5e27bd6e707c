"""What a recipe would run, without running it: the resolved config, the placement, each role's layout and a
memory estimate per rank (``<recipe>.py --dry-run --world-size N``; no torchrun, no process group).

The memory estimate counts weights and optimizer state, which dominate at scale and are exact given the layout:
a trained role keeps float32 weights, float32 gradients and two Adam moments (16 bytes per parameter), sharded over
all its ranks (FSDP over dp, TP over tp, PP over pp); a frozen role keeps its weights in ``model.dtype``. While
generating, each actor rank also holds its generation shard (the weights in ``model.dtype`` split ``rollout.tp``
ways) and its KV cache (sized here for the batch at full length). Activations, the engine's working buffers and
FSDP's gathered blocks (one block at a time) are not counted.
"""

from __future__ import annotations

import torch

from spmd_rlhf.config import to_yaml
from spmd_rlhf.config_schema import FrameworkConfig
from spmd_rlhf.models import DecoderLM
from spmd_rlhf.models.args import DecoderArgs, read_decoder_args
from spmd_rlhf.runtime.placement import place_roles

TRAINING_BYTES_PER_PARAMETER = 16
"""float32 weight + float32 gradient + Adam's two float32 moments."""

_HEADS = {"actor": "lm", "reference": "lm", "critic": "value", "cost_critic": "value", "reward": "score", "cost": "score"}


def parameter_count(args: DecoderArgs, head: str) -> int:
    """Parameters of the model ``args`` describes with ``head`` (counted on the meta device, nothing allocated)."""
    with torch.device("meta"):
        model = DecoderLM(args, head=head)
    return sum(param.numel() for param in {id(p): p for p in model.parameters()}.values())


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.1f} MiB"


def describe(config: FrameworkConfig, world_size: int) -> str:
    """The dry-run report: resolved config, pools, each role's layout and per-rank state, per-rank totals."""
    from spmd_rlhf.recipes.base import ensure_tiny_assets

    ensure_tiny_assets(config)
    placement = place_roles(config, world_size)
    config, plan = placement.config, placement.plan
    compute_bytes = getattr(torch, config.model.dtype).itemsize
    lines = ["# resolved config", to_yaml(config).rstrip(), ""]
    if plan:
        lines += [plan.rstrip(), ""]
    lines.append(f"# placement: {config.placement}, world size {world_size}")
    lines.append(f"{'role':<12} {'ranks':<10} {'pp':>3} {'dp':>3} {'tp':>3} {'parameters':>14}  per-rank state")
    per_rank = [0.0] * world_size
    for name, (pool, dims) in placement.roles.items():
        role = getattr(config, name)
        if name in ("reward", "cost") and role.kind == "rule":
            lines.append(f"{name:<12} {_ranks(pool.ranks):<10} {'':>3} {'':>3} {'':>3} {'rule':>14}  none (reward.rule={role.rule})")
            continue
        args = read_decoder_args(role.model_path or config.model.path)
        count = parameter_count(args, _HEADS[name])
        trained = name in ("actor", "critic", "cost_critic")
        state = count * (TRAINING_BYTES_PER_PARAMETER if trained else compute_bytes) / len(pool)
        what = "weights + grads + Adam, float32" if trained else f"weights, {config.model.dtype}"
        lines.append(
            f"{name:<12} {_ranks(pool.ranks):<10} {dims.pp:>3} {dims.dp:>3} {dims.tp:>3} {count:>14,}  {_mib(state)} ({what})"
        )
        for rank in pool.ranks:
            per_rank[rank] += state
    actor_ranks = placement.roles["actor"][0].ranks
    generation = _generation_bytes(config, actor_ranks, compute_bytes)
    lines += ["", "# memory per rank (weights and optimizer state; activations not counted)"]
    for rank, state in enumerate(per_rank):
        extra = f" + {_mib(generation)} while generating" if rank in actor_ranks else ""
        lines.append(f"rank {rank}: {_mib(state)}{extra}")
    return "\n".join(lines) + "\n"


def _generation_bytes(config: FrameworkConfig, actor_ranks: tuple[int, ...], compute_bytes: int) -> float:
    """One actor rank's generation shard plus its KV cache with its replica's share of the batch at full length."""
    args = read_decoder_args(config.model.path)
    tp = config.rollout.tp
    shard = parameter_count(args, "lm") * compute_bytes / tp
    replicas = len(actor_ranks) // tp
    rows = -(-config.data.batch_size * config.rollout.n // replicas)
    tokens = rows * (config.data.max_prompt_length + config.rollout.max_new_tokens)
    kv_per_token = 2 * args.num_layers * (args.num_kv_heads // tp) * args.head_dim * compute_bytes
    return shard + tokens * kv_per_token


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 else ",".join(map(str, ranks))
