"""Pipeline parallelism: split a ``DecoderLM`` into stages and run micro-batches through them with
``torch.distributed.pipelining`` (1F1B or GPipe).

A stage is the same ``DecoderLM`` with the layers of other stages removed (layer names keep their global index, so
checkpoints and Hugging Face names are unchanged); the first stage keeps the embedding, the last the final norm and
the head. Each stage is then tensor- / data-parallelized like a whole model (``parallelize.parallelize``).

Every stage of a pipeline sees the same micro-batches, stacked along dim 0 at common shapes (a schedule needs every
micro-batch to have the same shapes; ``training.packing.stack_packed`` pads packed ones so). The first stage feeds
``input_ids``; every stage gets the keyword inputs (position ids, ``cu_seqlens``, the row's length), which the
schedule splits into the same ``[1, ...]`` micro-batches. Every stage hands on hidden states, the last its final
norm's, so each stage's input and output shapes are known before it runs and are declared to the schedule, which
then infers none (left to infer them, torch 2.13 runs a forward of the first micro-batch, and in training a backward,
on every stage in every call; torch 2.11 a forward). The last stage turns each micro-batch's hidden states into a
result (the head's outputs, then a loss to back-propagate or per-token values) with ``output_fn``, which receives
the micro-batch's index alongside them (the caller knows what its rows hold: ``training.packing.run_pipelined``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from spmd_rlhf.data.batch import to_device_together
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.length_buckets import LengthBuckets, OneLengthClass, places_to_move, with_places_moved

SCHEDULES = ("1f1b", "gpipe")
"""The pipeline schedules of ``torch.distributed.pipelining`` a role may use (imported when a pipeline runs: the
package pulls in ``torch.export`` and dynamo, about a second of every process's start)."""

OutputFunction = Callable[[torch.Tensor, int], torch.Tensor]
"""(last stage's output for one micro-batch, that micro-batch's index) -> a loss (training) or a result tensor."""

PER_SEQUENCE_KWARGS = ("cu_seqlens",)
"""Keyword inputs the model takes without a batch dimension: the schedule hands each micro-batch ``[1, n]`` slices."""

MICRO_BATCH = "micro_batch"
"""The keyword input that carries a micro-batch's index to ``Pipeline.run``'s hook, which takes it out."""


def stage_layers(num_layers: int, pp: int, *, role: str = "model") -> list[range]:
    """Layer indices of each of ``pp`` stages: contiguous, sizes differing by at most one (earlier stages larger)."""
    if pp > num_layers:
        raise ValueError(f"{role}.pp={pp} exceeds the model's {num_layers} layers; use at most one stage per layer")
    base, extra = divmod(num_layers, pp)
    bounds = [0]
    for stage in range(pp):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(bounds[stage], bounds[stage + 1]) for stage in range(pp)]


def split_stage(model: DecoderLM, *, stage: int, pp: int, role: str = "model") -> DecoderLM:
    """``model`` cut down in place to pipeline stage ``stage`` of ``pp`` (unchanged when ``pp == 1``)."""
    if pp == 1:
        return model
    if model.head == "lm" and model.args.tie_word_embeddings:
        raise ValueError(
            f"{role}.pp={pp}: the model ties its embedding and LM head, which would sit on different pipeline stages; "
            f"use {role}.pp=1 (tensor and data parallelism work with tied weights)"
        )
    keep = stage_layers(model.args.num_layers, pp, role=role)[stage]
    for index in list(model.model.layers.keys()):
        if int(index) not in keep:
            del model.model.layers[index]
    if stage > 0:
        model.model.embed_tokens = None
    if stage < pp - 1:
        model.model.norm = None
        setattr(model, "lm_head" if model.head == "lm" else "score", None)
    return model


class Pipeline:
    """This rank's stage of a pipeline over ``group`` (the ranks holding the other stages of the same replica)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        stage: int,
        stage_ranks: list[int],
        group: dist.ProcessGroup,
        device: torch.device,
        schedule: str,
        activation_dtype: torch.dtype,
    ) -> None:
        """``stage_ranks``: the global rank of each stage, in stage order (``group`` holds exactly these ranks);
        ``activation_dtype``: the dtype the stages' hidden states are in (the layers' compute dtype)."""
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        self.module, self.stage, self.num_stages = module, stage, len(stage_ranks)
        self.group, self.device, self.schedule, self.activation_dtype = group, device, schedule, activation_dtype
        # A group numbers its members by ascending global rank; stages follow the pool's order, which may differ.
        self.stage_to_group_rank = {index: dist.get_group_rank(group, rank) for index, rank in enumerate(stage_ranks)}

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches the schedule runs: 1F1B needs one per stage."""
        return self.num_stages if self.schedule == "1f1b" else 1

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def run(
        self,
        input_ids: torch.Tensor,
        model_kwargs: dict[str, torch.Tensor | int],
        *,
        output_fn: OutputFunction,
        train: bool,
        host_inputs: list[dict[str, int | LengthBuckets | OneLengthClass]] | None = None,
    ) -> list[torch.Tensor]:
        """Run micro-batches ``input_ids`` ``[micro_batches, tokens]`` (read by the first stage) with ``model_kwargs``
        (``[micro_batches, ...]`` each, or an int every micro-batch shares; every stage) through the pipeline, one
        micro-batch per row; with ``train``, back-propagate each micro-batch's ``output_fn`` loss (gradients
        accumulate, unscaled). ``host_inputs``: each micro-batch's own keyword inputs known on the host (its longest
        sequence, a long row's length classes: ``training.packing.stack_packed``), given to every stage's forward of
        that micro-batch. Returns the ``output_fn`` results in micro-batch order on the last stage, an empty list
        elsewhere."""
        num_micro_batches = input_ids.shape[0]
        # A fresh stage per call: the shapes it is declared change with the micro-batch sizes from call to call.
        from torch.distributed import pipelining

        inputs, outputs = self.stage_shapes(input_ids.shape[1], train=train)
        stage = pipelining.PipelineStage(
            self.module,
            self.stage,
            self.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )
        stage.stage_index_to_group_rank = dict(self.stage_to_group_rank)
        schedule_class = {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe}[self.schedule]
        schedule = schedule_class(
            stage, num_micro_batches, loss_fn=lambda output, index: output_fn(output, int(index)), scale_grads=False
        )
        args, kwargs, per_micro_batch = self._on_device(input_ids, model_kwargs, host_inputs or [])
        # Each micro-batch's index rides along as the "target", so the last stage knows which micro-batch it holds.
        target = torch.arange(num_micro_batches)[:, None] if self.is_last else None
        if per_micro_batch:
            # And as a keyword input, split by the schedule like the others and kept on the host, so that the hook
            # reads it without a wait: which micro-batch's host inputs the forward takes.
            kwargs[MICRO_BATCH] = torch.arange(num_micro_batches)[:, None]
        results: list[torch.Tensor] = []
        run = schedule.step if train else schedule.eval
        # The hook (not a wrapper module) keeps the stage's module the FSDP module the schedule syncs gradients of.
        hooks = (
            self.module.register_forward_pre_hook(
                functools.partial(_micro_batch_inputs, per_micro_batch), with_kwargs=True
            ),
            self.module.register_forward_hook(functools.partial(_as_declared, self.stage, outputs)),
        )
        try:
            run(*args, target=target, losses=results, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        return results

    def stage_shapes(self, tokens: int, *, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's input and output at this stage, as meta tensors, for micro-batches of ``tokens`` tokens
        (a row's, or a context-parallel rank's chunk of it): token ids ``[1, tokens]`` into the first stage, hidden
        states ``[1, tokens, hidden]`` between stages (this rank's ``tokens / tp`` under sequence parallelism) and
        out of the last stage (whose final norm gathers them), in the activation dtype; with ``train``, hidden
        states require their gradient (a stage computes its input's for the stage before)."""

        def hidden(length: int) -> torch.Tensor:
            size = (1, length, self.module.args.hidden_size)
            return torch.empty(size, dtype=self.activation_dtype, device="meta", requires_grad=train)

        between = tokens // self.module.sequence_parallel
        inputs = torch.empty(1, tokens, dtype=torch.long, device="meta") if self.stage == 0 else hidden(between)
        return inputs, hidden(tokens if self.is_last else between)

    def _on_device(
        self, input_ids: torch.Tensor, model_kwargs: dict, host_inputs: list[dict]
    ) -> tuple[tuple, dict, list[dict]]:
        """``run``'s inputs on the stage's device (``input_ids`` on the first stage only), moved in one copy to a GPU:
        the schedule's positional and keyword inputs, and each micro-batch's host inputs with a long row's length
        classes' index tensor moved."""
        tensors = {key: value for key, value in model_kwargs.items() if torch.is_tensor(value)}
        if self.stage == 0:
            tensors[_INPUT_IDS] = input_ids
        for index, inputs in enumerate(host_inputs):
            tensors |= places_to_move(inputs["length_classes"], f"{_PLACES}{index}")
        moved = to_device_together(tensors, self.device)
        args = (moved[_INPUT_IDS],) if self.stage == 0 else ()
        kwargs = {key: moved.get(key, value) for key, value in model_kwargs.items()}
        per_micro_batch = [
            inputs | {"length_classes": with_places_moved(inputs["length_classes"], moved, f"{_PLACES}{index}")}
            for index, inputs in enumerate(host_inputs)
        ]
        return args, kwargs, per_micro_batch


_INPUT_IDS, _PLACES = "input_ids", "length_places_"
"""``Pipeline._on_device``'s names for what it moves beside the keyword inputs (which the model never names so)."""


def _as_declared(
    stage: int, declared: torch.Tensor, module: torch.nn.Module, args: tuple, output: torch.Tensor
) -> None:
    """A stage's output checked against the shape and dtype declared for it (``Pipeline.stage_shapes``), on the
    host: the next stage receives into a buffer of the declared ones."""
    if output.shape != declared.shape or output.dtype != declared.dtype:
        raise RuntimeError(
            f"pipeline stage {stage} returned {output.dtype} {tuple(output.shape)} where {declared.dtype} "
            f"{tuple(declared.shape)} was declared to the schedule (Pipeline.stage_shapes)"
        )


def _micro_batch_inputs(
    per_micro_batch: list[dict], module: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    """A micro-batch's model inputs as the model takes them: the ``[1, n]`` slices of ``PER_SEQUENCE_KWARGS`` as
    ``[n]``, and the micro-batch's own host inputs (``per_micro_batch``) in place of its index."""
    for key in PER_SEQUENCE_KWARGS:
        if kwargs.get(key) is not None and kwargs[key].dim() == 2:
            kwargs[key] = kwargs[key][0]
    index = kwargs.pop(MICRO_BATCH, None)
    if index is not None:
        kwargs.update(per_micro_batch[int(index)])
    return args, kwargs
