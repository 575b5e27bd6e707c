"""Numbers that shape the engine's schedule, agreed across the ranks that run one model together.

A tensor-parallel generation replica is ``tp_g`` ranks running one scheduler each on the same requests, and every
step's forward has collectives over the replica (the row-parallel all-reduces, the LM head's gather). If one rank's
schedule differs (its larger KV cache admits one more sequence, or preempts one fewer), the ranks enter collectives of
different shapes or in different numbers and hang. So each number that shapes the schedule (block size, cache
blocks, batch limits) is the minimum over the model's mesh before the engine starts: every rank runs the schedule the
most constrained one can afford. The requests themselves are the same on every rank of a replica by construction
(``hybrid.HybridEngine.replica_rows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def schedule_groups(model: torch.nn.Module) -> list[dist.ProcessGroup]:
    """The process groups of the mesh ``model``'s parameters are sharded over, one per mesh dimension of size > 1
    (a TP-sharded generation model: its generation TP group); empty for a model on one rank."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return [mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1]
    return []


def agree_minimum(values: list[int], groups: list[dist.ProcessGroup], device: torch.device) -> list[int]:
    """Each of ``values`` replaced by its minimum over every rank of ``groups`` (the dimensions of one mesh, so the
    minimum over each in turn is the minimum over the mesh). Every rank of the mesh calls it with as many values."""
    if not groups:
        return list(values)
    agreed = torch.tensor(values, dtype=torch.int64, device=device)
    for group in groups:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return agreed.tolist()
