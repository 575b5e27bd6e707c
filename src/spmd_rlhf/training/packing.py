"""How the rows of one micro-batch are fed to the model, and where each response token's output comes back.

Two layouts of the same rows (the rollout layout of ``training.sharded_model``):

- ``PackedRows`` (every training and log-prob pass): the attended tokens of all rows laid end to end in one
  ``[1, total_tokens]`` sequence, with ``cu_seqlens`` and position ids restarting at 0 for each row, so no padding
  token is fed; the LM / value head runs only at the positions that predict a response token (the model's
  ``output_positions``). A pipeline schedule needs every micro-batch of a call to have the same shapes:
  ``stack_packed`` pads the packed micro-batches to common sizes (a few padding tokens as extra sequences, and
  repeated output positions) and the caller trims each output to ``output_count``.
- ``PaddedRows``: the ``[rows, P + R]`` padded rows with their attention mask; the head runs at every position and
  the response positions are picked after.

Either way ``response_outputs`` gives the model's outputs at the positions predicting (or valuing) the response
tokens flat, ``[response_tokens, ...]`` in row-major order of ``response_mask``, and ``scatter`` puts per-token
results back into ``[rows, R]`` (zero where the mask is 0): losses and callers see the same tensors in both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from spmd_rlhf.data.batch import Batch, to_device, to_device_together
from spmd_rlhf.models import attention
from spmd_rlhf.models.length_buckets import (
    LengthBuckets,
    OneLengthClass,
    length_buckets,
    places_to_move,
    with_places_moved,
)

if TYPE_CHECKING:
    from spmd_rlhf.models.pipeline import Pipeline

PACKED_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "response_mask")
"""The fields of the rollout layout that a micro-batch reads to lay its rows out and find its response tokens."""


class MicroBatch:
    """One micro-batch's rows (``rows``, rollout layout) and their response tokens where ``response_mask`` is set."""

    def __init__(self, rows: Batch) -> None:
        self.rows = rows
        """The rows in the rollout layout: losses read their per-row fields (advantages, old log-probs) here."""
        self.response_mask = rows["response_mask"].bool()
        self.response_index = self.response_mask.nonzero(as_tuple=True)
        """(row, column) of each response token, row-major: the order of every flat per-token tensor."""
        self._on_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def response_tokens(self) -> int:
        return len(self.response_index[0])

    def response_outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        """The model's outputs at the positions that predict / value each response token: ``[response_tokens, ...]``."""
        raise NotImplementedError

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """Every host tensor a pass over these rows sends to the device: the model's inputs (``model_inputs``), the
        response labels and the response index; ``on_device`` moves them in one copy."""
        row, column = self.response_index
        return {
            **self._host_inputs(),
            "labels": self.rows["responses"][self.response_index],
            "index_row": row,
            "index_column": column,
        }

    def _host_inputs(self) -> dict[str, torch.Tensor]:
        """The model's tensor inputs on the host, ``output_positions`` among them where the layout has them."""
        raise NotImplementedError

    def on_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """``host_tensors`` on ``device``, moved there together once (``to_device_together``: one pinned copy from
        the host to a GPU) and kept for the micro-batch's later reads."""
        if device not in self._on_device:
            self._on_device[device] = to_device_together(self.host_tensors(), device)
        return self._on_device[device]

    def model_inputs(self, device: torch.device, *, per_token: bool) -> dict[str, torch.Tensor | int]:
        """Keyword arguments of ``DecoderLM.forward`` for these rows; ``per_token``: the head's outputs are wanted
        per token (LM, value heads), not per sequence (score head: no ``output_positions``)."""
        moved = self.on_device(device)
        names = [name for name in self._host_inputs() if per_token or name != "output_positions"]
        return {name: moved[name] for name in names} | self._host_values()

    def _host_values(self) -> dict[str, int]:
        return {}

    def response_labels(self, device: torch.device) -> torch.Tensor:
        """The response token ids ``[response_tokens]``, in the order of ``response_outputs``."""
        return self.on_device(device)["labels"]

    def device_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``response_index`` on ``device``, copied there once for every per-token tensor of the micro-batch."""
        moved = self.on_device(device)
        return moved["index_row"], moved["index_column"]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token ``values`` ``[response_tokens]`` as ``[rows, R]``, zero where ``response_mask`` is 0;
        differentiable w.r.t. ``values``."""
        full = values.new_zeros(self.response_mask.shape)
        return full.index_put(self.device_index(values.device), values)


def long_row_classes(cu_seqlens: torch.Tensor, total: int) -> LengthBuckets | OneLengthClass | None:
    """The length classes of a packed row of ``total`` tokens, from its host offsets ``cu_seqlens``, where the model
    attends it per class (over ``attention.MASK_TOKEN_LIMIT`` tokens), else None. Built by whoever lays a row out on
    the host and handed to the model with it (``length_classes``), which would otherwise read the offsets back."""
    return length_buckets(cu_seqlens, total) if total > attention.MASK_TOKEN_LIMIT else None


def padded_offsets(cu_seqlens: torch.Tensor, total: int, multiple: int) -> tuple[torch.Tensor, int]:
    """Host offsets of a packed row of ``total`` tokens and its length once padded by one sequence to a multiple of
    ``multiple`` tokens (as ``models.sequence_parallel.padded_row`` pads it; unchanged where it is one already)."""
    padding = -total % multiple
    if padding == 0:
        return cu_seqlens, total
    return torch.cat([cu_seqlens, cu_seqlens.new_tensor([total + padding])]), total + padding


class PackedRows(MicroBatch):
    """The rows' attended tokens packed into one sequence (see the module docstring).

    Holds ``[total_tokens]`` token ids and positions and ``[response_tokens]`` output positions: no ``[rows, P + R]``
    copies beyond the rows themselves. Built on the host from host rows (``Trainer.update`` packs there), it reads
    them once, so the longest sequence's length is known without reading anything back from the device."""

    def __init__(self, rows: Batch, *, multiple: int | None = 1) -> None:
        """``multiple``: the model pads the row by one sequence to a multiple of it (sequence parallelism's tp,
        ``models.sequence_parallel.padded_row``), so the length classes are the padded row's; None: the row reaches
        the model laid out again (a pipeline's common shapes: ``stack_packed``; a context-parallel group's row),
        where its classes are built for that layout, so none here."""
        super().__init__(rows)
        attended = rows["attention_mask"].bool()
        lengths = attended.sum(dim=1)
        prompt_length = rows["prompts"].shape[1]
        prompt_tokens = attended[:, :prompt_length].sum(dim=1)
        unseen_response_tokens = (self.response_mask & ~attended[:, prompt_length:]).sum(dim=1)
        row_lengths, prompt_tokens, unseen_response_tokens = torch.stack(
            [lengths, prompt_tokens, unseen_response_tokens]
        ).tolist()
        if 0 in prompt_tokens:
            raise ValueError(
                "a row has no prompt token: its first response token would have nothing to be predicted from"
            )
        if any(unseen_response_tokens):
            raise ValueError(
                "a response token in response_mask is outside attention_mask: the model would never see it"
            )
        self.max_seqlen = max(row_lengths, default=0)
        """The longest row's attended tokens: the attention backends' bound, as a host value."""
        # Index of each attended token within its own row, and where each row starts in the packed sequence.
        index_in_row = attended.long().cumsum(dim=1) - 1
        ends = lengths.cumsum(dim=0)
        starts = ends - lengths
        self.input_ids = rows["input_ids"][attended][None]
        self.position_ids = index_in_row[attended][None]
        self.cu_seqlens = F.pad(ends, (1, 0)).to(torch.int32)
        row, column = self.response_index
        # The output at the token before response token t predicts (values) it.
        self.output_positions = starts[row] + index_in_row[:, prompt_length:][row, column] - 1
        total = self.input_ids.shape[1]
        self.length_classes = (
            None if multiple is None else long_row_classes(*padded_offsets(self.cu_seqlens, total, multiple))
        )
        """A row over ``MASK_TOKEN_LIMIT`` tokens: its sequences' length classes (or that they fall in one), built
        here from the host's offsets (the model would otherwise read ``cu_seqlens`` back from the device: a sync per
        forward); their index tensor travels with the model's inputs."""

    @property
    def total_tokens(self) -> int:
        return self.input_ids.shape[1]

    def _host_inputs(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seqlens": self.cu_seqlens,
            "output_positions": self.output_positions,
        }

    def host_tensors(self) -> dict[str, torch.Tensor]:
        return super().host_tensors() | places_to_move(self.length_classes, "length_places")

    def model_inputs(
        self, device: torch.device, *, per_token: bool
    ) -> dict[str, torch.Tensor | int | LengthBuckets | OneLengthClass]:
        """As ``MicroBatch.model_inputs``, with a long row's ``length_classes`` (their index tensor on ``device``)."""
        inputs = super().model_inputs(device, per_token=per_token)
        if self.length_classes is not None:
            inputs["length_classes"] = with_places_moved(self.length_classes, self.on_device(device), "length_places")
        return inputs

    def _host_values(self) -> dict[str, int]:
        return {"max_seqlen": self.max_seqlen}

    def response_outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        # The model already ran its head at the output positions only.
        return outputs

    def output_count(self, *, per_token: bool) -> int:
        """How many outputs the model returns for these rows: one per response token, else one per row (score)."""
        return self.response_tokens if per_token else len(self)


def stack_packed(
    micros: list[PackedRows], *, per_token: bool, multiple: int = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[dict[str, int | LengthBuckets | OneLengthClass]]]:
    """The model inputs of ``micros`` stacked along a new dim 0 at common sizes, for a pipeline schedule: ``input_ids``
    ``[M, T]`` and the keyword inputs ``position_ids`` ``[M, T]``, ``cu_seqlens`` ``[M, S]`` and (``per_token``)
    ``output_positions`` ``[M, R]``; ``T`` a multiple of ``multiple`` (sequence parallelism's tp: every stage then
    splits the row as it comes). Then each micro-batch's inputs known on the host (``Pipeline.run``'s
    ``host_inputs``): its longest sequence, padding included (``max_seqlen``), and a long row's ``length_classes``,
    which the model would otherwise find by reading ``cu_seqlens`` back from the device.

    Each micro-batch is padded at its end with at least one padding sequence of at least one token (token 0,
    position 0), so every sequence is non-empty whatever the attention backend, and each real sequence attends
    only to itself as before: its outputs are unchanged. Output positions are padded with position 0; micro-batch
    ``i``'s first ``micros[i].output_count(per_token=...)`` outputs are its own (scores included: the padding
    sequences come after the rows)."""
    num_offsets = max(len(micro.cu_seqlens) for micro in micros) + 1
    total = max(micro.total_tokens + num_offsets - len(micro.cu_seqlens) for micro in micros)
    total = -(-total // multiple) * multiple
    input_ids, position_ids, cu_seqlens, output_positions, host_inputs = [], [], [], [], []
    for micro in micros:
        padding_sequences = num_offsets - len(micro.cu_seqlens)
        # All padding sequences but the last hold one token; the last holds the rest.
        ends = micro.total_tokens + torch.arange(1, padding_sequences + 1, dtype=torch.int32)
        ends[-1] = total
        offsets = torch.cat([micro.cu_seqlens, ends])
        cu_seqlens.append(offsets)
        padding = total - micro.total_tokens
        input_ids.append(F.pad(micro.input_ids[0], (0, padding)))
        position_ids.append(F.pad(micro.position_ids[0], (0, padding)))
        output_positions.append(micro.output_positions)
        longest = max(micro.max_seqlen, padding - padding_sequences + 1)
        host_inputs.append({"max_seqlen": longest, "length_classes": long_row_classes(offsets, total)})
    kwargs = {"position_ids": torch.stack(position_ids), "cu_seqlens": torch.stack(cu_seqlens)}
    if per_token:
        count = max(len(positions) for positions in output_positions)
        kwargs["output_positions"] = torch.stack(
            [F.pad(positions, (0, count - len(positions))) for positions in output_positions]
        )
    return torch.stack(input_ids), kwargs, host_inputs


def run_pipelined(
    pipeline: Pipeline,
    micros: list[PackedRows],
    output_fn: Callable[[torch.Tensor, PackedRows], torch.Tensor],
    *,
    per_token: bool,
    train: bool,
) -> list[torch.Tensor]:
    """``output_fn(outputs, micro)`` of each of ``micros`` through ``pipeline`` at common shapes (``stack_packed``),
    on the last stage; with ``train``, back-propagated. Every stage hands on hidden states (the model's
    ``row_length``: the last stage's are its final norm's), so each stage's shapes are known before it runs
    (``Pipeline.stage_shapes``); the head runs here, at the micro-batch's output positions (per token) or each
    sequence's last token (a score head), and ``output_fn`` sees the micro-batch's own outputs. Returns the results,
    detached (none but on the last stage)."""
    input_ids, kwargs, host_inputs = stack_packed(
        micros, per_token=per_token, multiple=pipeline.module.sequence_parallel
    )
    reads = kwargs.pop("output_positions") if per_token else kwargs["cu_seqlens"][:, 1:].long() - 1
    kwargs["row_length"] = input_ids.shape[1]
    reads = to_device(reads, pipeline.device) if pipeline.is_last else reads

    def stage_output(hidden: torch.Tensor, index: int) -> torch.Tensor:
        micro = micros[index]
        outputs = pipeline.module.head_outputs(hidden[0].index_select(0, reads[index]))
        return output_fn(outputs[: micro.output_count(per_token=per_token)], micro)

    results = pipeline.run(input_ids, kwargs, output_fn=stage_output, train=train, host_inputs=host_inputs)
    return [result.detach() for result in results]


class PaddedRows(MicroBatch):
    """The rows as the padded ``[rows, P + R]`` batch. ``response_outputs`` copies the response positions' outputs
    out of the full ``[rows, P + R, ...]`` outputs (for logits, ``response_tokens * vocab`` in the compute dtype)."""

    def _host_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows["input_ids"], "attention_mask": self.rows["attention_mask"]}

    def response_outputs(self, outputs: torch.Tensor) -> torch.Tensor:
        response_length = self.response_mask.shape[1]
        prompt_length = self.rows["input_ids"].shape[1] - response_length
        return outputs[:, prompt_length - 1 : -1][self.device_index(outputs.device)]
