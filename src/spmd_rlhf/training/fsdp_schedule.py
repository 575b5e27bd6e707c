"""What FSDP2 does across the micro-batches of one call of a role's model: when units gather and reshard, when
gradients are reduce-scattered, and when HSDP's replicas all-reduce them.

By default FSDP gathers each unit for every micro-batch's forward (and again for its backward) and reduce-scatters
its gradient in every backward. ``ShardedModel`` changes that for a call of several micro-batches:

- a trained role that keeps its units gathered and its gradients unsharded (``accumulate_unsharded``) gathers each
  unit once, in the first forward, and reduce-scatters once, in the last backward;
- a forward-only call within ``forward_gather_mb`` (``gather_forward``) gathers each unit once for the call;
- under HSDP, a trained role that reduce-scatters every micro-batch all-reduces across the replicas (the collective
  that crosses nodes) once, in the last backward: the reduce-scattered gradients are summed in the sharded gradients
  until then; a streamed vocabulary (``models.streamed_vocabulary``), which FSDP does not manage, likewise sums its
  reduced gradients and all-reduces them across the replicas once, after the last backward.

Whatever happens inside, FSDP's defaults are back on the way out, even when a micro-batch raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.parallelize import unsharded_accumulation_bytes
from spmd_rlhf.models.streamed_vocabulary import vocabulary_stream


def gather_policy(
    model: DecoderLM,
    *,
    trainable: bool,
    pipelined: bool,
    offloaded: bool,
    compute_dtype: torch.dtype,
    accumulation_mb: float | None,
    forward_gather_mb: float | None,
) -> tuple[bool, bool]:
    """``(accumulate_unsharded, gather_forward)`` for a role's parallelized ``model``.

    ``accumulate_unsharded``: a mini-batch's micro-batches keep the parameters gathered from the first forward on
    and the gradients unsharded (accumulated in the reduce dtype), with one reduce-scatter and reshard in the last
    backward: one FSDP gather and one reduce-scatter per unit per mini-batch, whatever its micro-batch count (at dp =
    1 no FSDP copy per micro-batch: benchmarks/host_overhead.py --train). Always for a model of one FSDP unit
    (gathered whole anyway, bounded by ``fsdp_unit_mb``); otherwise when what it holds beyond FSDP fits
    ``accumulation_mb`` (``<role>.unsharded_accumulation_mb``; ``unsharded_accumulation_bytes``), and never with
    offload. ``gather_forward``: forward-only calls keep every unit gathered from their first micro-batch to their
    end, one gather per unit per call, where the parameters fit ``forward_gather_mb`` (``<role>.forward_gather_mb``).
    Neither under a pipeline."""
    accumulate = trainable and not pipelined and isinstance(model, FSDPModule)
    has_units = any(isinstance(module, FSDPModule) for module in model.modules() if module is not model)
    if accumulate and has_units:
        held = unsharded_accumulation_bytes(model, compute_dtype=compute_dtype)
        accumulate = not offloaded and (accumulation_mb is None or held <= accumulation_mb * 2**20)
    gather = False
    if has_units and not pipelined and not offloaded:
        held = unsharded_accumulation_bytes(model, compute_dtype=compute_dtype, gradients=False)
        gather = forward_gather_mb is None or 0 < held <= forward_gather_mb * 2**20
    return accumulate, gather


@contextlib.contextmanager
def micro_batch_schedule(
    module: nn.Module,
    *,
    micro_batches: int,
    train: bool,
    accumulate_unsharded: bool,
    gather_forward: bool,
    hybrid_replicas: int = 1,
) -> Iterator[Callable[[int], None]]:
    """Inside, call the yielded function with each micro-batch's index before running it (``micro_batches`` of them)
    on ``module`` (the FSDP root): it sets what the micro-batch's forward and backward do (module docstring)."""
    accumulate = train and accumulate_unsharded and micro_batches > 1
    gathered = accumulate or (not train and gather_forward and micro_batches > 1)
    all_reduce_once = train and not accumulate and micro_batches > 1 and hybrid_replicas > 1
    streamed = {}  # a tied pair's two modules share one stream and one weight
    if train and micro_batches > 1 and hybrid_replicas > 1:
        for each in module.modules():
            stream = vocabulary_stream(each)
            if stream is not None and stream.replica_group is not None and each.weight.requires_grad:
                streamed[id(stream)] = (stream, each.weight)
    # The units below the root, which FSDP never reshards after the root's forward.
    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule) and unit is not module]
    if gathered:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)

    def before(index: int) -> None:
        last = index == micro_batches - 1
        if accumulate:
            module.set_requires_gradient_sync(last)
            module.set_reshard_after_backward(last)
        elif all_reduce_once:
            module.set_requires_all_reduce(last)

    for stream, _ in streamed.values():
        stream.defer_replica_reduce = True
    try:
        yield before
        for stream, weight in streamed.values():
            if weight.grad is not None:  # every rank ran the same backwards, so every replica has it or none does
                stream.all_reduce_across_replicas(weight.grad.to_local())
    finally:
        for stream, _ in streamed.values():
            stream.defer_replica_reduce = False
        if gathered:
            for unit in units:
                unit.set_reshard_after_forward(True, recurse=False)
                if not train:
                    unit.reshard()  # a forward-only call's units, which no backward reshards
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
        if all_reduce_once:
            module.set_requires_all_reduce(True)
