"""Context parallelism in a role's forward and backward passes: the ``cp`` DP ranks of a group run every micro-batch
of the group together, each rank a contiguous ``1 / cp`` chunk of its packed row, so no rank holds a whole long row's
activations.

Each rank keeps its own rows (as a DP rank does: the runtime's dispatch, the loss and its normalisation, FSDP and the
results are unchanged). Per call, the ranks of a group exchange their packed micro-batches (token ids, positions,
sequence offsets and where the head reads: host tensors, ``exchange_rows``); then, for micro-batch ``i`` of rank
``0, 1, ..., cp - 1`` in turn (``schedule``), every rank of the group:

1. runs the decoder on its chunk of that row (``ContextRow.chunk``; the row padded with one padding sequence to a
   multiple of ``cp`` tokens, counted in ``padding_tokens``), each layer's attention over the whole row by
   all-to-all (``models.context_parallel.ulysses_attend``, installed by ``parallelize``);
2. runs the head on its chunk's final hidden states at the positions it holds of those the head reads (response
   positions, or each sequence's last token for a score head); an LM head's logits ``[held, vocab / tp]`` become
   each token's log-prob (and, in training, entropy) right there, chunk by chunk over the vocabulary
   (``TokenStatistics``, ``models.logprob``), so no rank holds a whole row's logits;
3. all-gathers those per-token outputs over the group, in row order (``gather_rows``, whose backward hands each rank
   the gradient of its own rows): ``[outputs, 2]`` floats for an LM head, ``[outputs]`` for a value or score head;
4. on the row's owner, the caller's loss or result function runs on them as on the head's outputs without context
   parallelism (``ShardedModel.response_log_probs`` reads the gathered log-probs); the others take part in the
   backward, each through its own chunk's head.

Memory per rank: one chunk's activations (``row / cp`` tokens) and one chunk's head outputs, plus the gathered
per-token floats. Traffic per micro-batch: Ulysses' all-to-alls (or the ring's passes) in every layer and one
all-gather of the per-token outputs (and its reduce-scatter in the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
import torch.nn.functional as F

from spmd_rlhf.data.batch import to_device, to_device_together
from spmd_rlhf.models.length_buckets import LengthBuckets, OneLengthClass, places_to_move, with_places_moved
from spmd_rlhf.models.pipeline import Pipeline
from spmd_rlhf.models.ring_attention import zigzag_positions
from spmd_rlhf.training.packing import PackedRows, long_row_classes
from spmd_rlhf.training.router_replay import RouterReplay


@dataclass(frozen=True)
class ContextRow:
    """One micro-batch's packed row as every rank of a context-parallel group sees it (host tensors)."""

    input_ids: torch.Tensor
    """``[T]`` token ids, padded to a multiple of ``cp`` by one padding sequence."""
    position_ids: torch.Tensor
    """``[T]``, restarting at 0 for each sequence."""
    cu_seqlens: torch.Tensor
    """``[sequences + 1]`` int32 offsets (the padding sequence included)."""
    max_seqlen: int
    reads: torch.Tensor
    """``[outputs]`` the row positions the head reads, ascending: response positions, or each sequence's last token."""
    padding_tokens: int
    zigzag: bool = False
    """Ring attention's layout: the row cut into ``2 cp`` chunks, rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r``
    (``models.ring_attention.zigzag_positions``); else one contiguous chunk per rank (Ulysses)."""
    rows: int = 0
    """The micro-batch's rows (a mixture-of-experts model's router losses are weighted by them)."""
    routes: torch.Tensor | None = None
    """Router replay: the experts recorded for each token ``[T, moe_layers, k]`` (-1 for the padding: the router's
    own choice), which each rank's routers take at its chunk's positions (``chunk_routes``)."""

    @classmethod
    def of(
        cls,
        micro: PackedRows,
        *,
        cp: int,
        per_token: bool,
        zigzag: bool = False,
        routes: torch.Tensor | None = None,
        multiple: int = 1,
    ) -> ContextRow:
        """``micro``'s row for a group of ``cp`` ranks; ``routes``: its packed tokens' recorded experts, if replayed;
        ``multiple``: each rank's chunk a multiple of it (sequence parallelism's tp, which splits the chunk)."""
        total = micro.total_tokens
        padding = -total % ((2 * cp if zigzag else cp) * multiple)
        input_ids, position_ids = micro.input_ids[0], micro.position_ids[0]
        cu_seqlens = micro.cu_seqlens
        reads = micro.output_positions if per_token else cu_seqlens[1:].long() - 1
        if padding:
            input_ids = F.pad(input_ids, (0, padding))
            position_ids = torch.cat([position_ids, torch.arange(padding, dtype=position_ids.dtype)])
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total + padding])])
            if routes is not None:
                routes = torch.cat([routes, routes.new_full((padding, *routes.shape[1:]), -1)])
        max_seqlen = max(micro.max_seqlen, padding)
        return cls(input_ids, position_ids, cu_seqlens, max_seqlen, reads.long(), padding, zigzag, len(micro), routes)

    def positions(self, rank: int, cp: int) -> torch.Tensor:
        """The row positions of rank ``rank``'s chunk ``[T / cp]``, in its order."""
        tokens = len(self.input_ids)
        if self.zigzag:
            return zigzag_positions(rank, cp, tokens)
        return torch.arange(rank * tokens // cp, (rank + 1) * tokens // cp)

    def chunk(self, rank: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s token ids and positions ``[T / cp]``."""
        positions = self.positions(rank, cp)
        return self.input_ids[positions], self.position_ids[positions]

    def padded_to(self, length: int, offsets: int) -> ContextRow:
        """This row with ``offsets - len(cu_seqlens)`` (at least one) padding sequences appended, one token each but
        the last, which takes the rest up to ``length`` tokens: the common shapes a pipeline schedule needs."""
        total, extra = len(self.input_ids), offsets - len(self.cu_seqlens)
        ends = total + torch.arange(1, extra + 1, dtype=self.cu_seqlens.dtype)
        ends[-1] = length
        padding = length - total
        routes = self.routes
        if routes is not None:
            routes = torch.cat([routes, routes.new_full((padding, *routes.shape[1:]), -1)])
        return replace(
            self,
            input_ids=F.pad(self.input_ids, (0, padding)),
            position_ids=F.pad(self.position_ids, (0, padding)),
            cu_seqlens=torch.cat([self.cu_seqlens, ends]),
            max_seqlen=max(self.max_seqlen, length - int(ends[-2]) if extra > 1 else padding),
            padding_tokens=self.padding_tokens + padding,
            routes=routes,
        )

    def gather_inputs(self, rank: int, cp: int, *, labels: bool) -> tuple[dict[str, torch.Tensor], int]:
        """What rank ``rank`` reads to hand its chunk's head outputs to the group (``_gathered_outputs``), as host
        tensors to move with its other inputs: its chunk's positions the head reads (``held``), with ``labels`` the
        tokens they predict, which of the rows ``gather_rows`` lays end to end in rank order are the ranks' (``keep``:
        each rank's padded to the most any holds) and, for zig-zag chunks, where each lies in row order (``order``);
        then that most, on the host."""
        positions = [self.positions(index, cp) for index in range(cp)]
        held = [torch.isin(chunk, self.reads).nonzero().flatten() for chunk in positions]
        most = max(map(len, held))
        inputs = {"held": held[rank], "keep": torch.cat([torch.arange(len(h)) + i * most for i, h in enumerate(held)])}
        if labels:
            inputs["labels"] = self.input_ids[positions[rank][held[rank]] + 1]  # the next token of the row
        if self.zigzag:
            inputs["order"] = torch.argsort(torch.cat([chunk[h] for chunk, h in zip(positions, held)]))
        return inputs, most

    def length_classes(self, model: torch.nn.Module) -> LengthBuckets | OneLengthClass | None:
        """The row's length classes (``training.packing.long_row_classes``) where ``model``'s attention takes the
        whole row's batch (Ulysses'; ring attention reads only the offsets)."""
        return None if model.context_parallel == "ring" else long_row_classes(self.cu_seqlens, len(self.input_ids))

    def real_tokens(self, rank: int, cp: int) -> torch.Tensor:
        """``[T / cp]`` bool: which tokens of rank ``rank``'s chunk are the micro-batch's (not the padding)."""
        return self.positions(rank, cp) < len(self.input_ids) - self.padding_tokens

    def chunk_routes(self, rank: int, cp: int) -> torch.Tensor | None:
        """The recorded experts of rank ``rank``'s chunk ``[T / cp, moe_layers, k]`` (None without router replay)."""
        return None if self.routes is None else self.routes[self.positions(rank, cp)]


TokenStatistics = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(an LM head's logits ``[n, vocab / tp]`` at a chunk's output positions, their labels ``[n]``) -> per-token floats
``[n, m]``: the log-prob of each label, and in training its distribution's entropy (``ShardedModel``'s)."""


def exchange_rows(rows: list[ContextRow], group: dist.ProcessGroup) -> list[list[ContextRow]]:
    """Every rank of ``group``'s micro-batch rows, by group rank (one object all-gather per call)."""
    everyone: list[list[ContextRow] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, rows, group=group)
    return everyone


def schedule(count: int, cp: int) -> list[tuple[int, int]]:
    """(owner, index) of the group's micro-batches in the order every rank runs them: each index's micro-batch of
    every rank in turn, so each rank owns every ``cp``-th one."""
    return [(owner, index) for index in range(count) for owner in range(cp)]


def gather_rows(held: torch.Tensor, most: int, keep: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``held`` rows (at most ``most`` each) laid end to end in rank order on every rank: each rank's
    padded to ``most``, gathered, and the real ones kept (``keep``, on the device: ``ContextRow.gather_inputs``);
    the backward sums the gradients over the group and hands each rank those of its own rows."""
    padded = F.pad(held, (0, 0) * (held.dim() - 1) + (0, most - held.shape[0]))
    # torch 2.13 renames all_gather_tensor_autograd (2.11 has only that name) to all_gather_single_autograd.
    gather = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
    gathered = gather(padded.contiguous(), 0, group)
    if hasattr(gathered, "wait"):
        gathered = gathered.wait()
    return gathered.index_select(0, keep)


def context_parallel_step(
    model: torch.nn.Module,
    row: ContextRow,
    micro: PackedRows | None,
    output_fn: Callable[[torch.Tensor, PackedRows], torch.Tensor],
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    train: bool,
    statistics: TokenStatistics | None = None,
    every_rank: Callable[[ContextRow, torch.Tensor], torch.Tensor | None] | None = None,
) -> torch.Tensor | None:
    """One micro-batch of the group (steps 1-4 of the module docstring): this rank's chunk of ``row`` through
    ``model``'s decoder and head (an LM head's logits through ``statistics``), the per-token outputs gathered over
    ``group``; on the row's owner (``micro`` given) ``output_fn`` on them (its result returned, back-propagated with
    ``train``), elsewhere the backward's share. Inputs go to ``device``. ``every_rank(row, real_tokens)``, when
    given, runs on every rank of the group right after its chunk's decoder forward (``real_tokens``: the chunk's
    tokens that are not padding, on ``device``); a tensor it returns joins what the rank back-propagates (a
    mixture-of-experts model's router losses: each rank's tokens' share)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    input_ids, position_ids = row.chunk(rank, cp)
    reads, most = row.gather_inputs(rank, cp, labels=statistics is not None)
    inputs = {"input_ids": input_ids[None], "position_ids": position_ids[None], "cu_seqlens": row.cu_seqlens} | reads
    if every_rank is not None:
        inputs["real_tokens"] = row.real_tokens(rank, cp)
    classes = row.length_classes(model)
    moved = to_device_together(inputs | places_to_move(classes, "length_places"), device)  # one copy: no wait
    hidden = model.hidden_states(
        moved["input_ids"],
        moved["position_ids"],
        cu_seqlens=moved["cu_seqlens"],
        max_seqlen=row.max_seqlen,
        row_length=len(row.input_ids),
        length_classes=with_places_moved(classes, moved, "length_places"),
    )
    extra = None if every_rank is None else every_rank(row, moved["real_tokens"])
    gathered = _gathered_outputs(model, hidden[0], moved, most, group=group, statistics=statistics)
    if micro is None:
        nothing = gathered[:0].sum()  # its backward still runs the gather's, which hands this rank its rows' gradient
        if train:
            (nothing if extra is None else nothing + extra).backward()
        return None
    result = output_fn(gathered, micro)
    if train:
        (result if extra is None else result + extra).backward()
    return result


def _gathered_outputs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    reads: dict[str, torch.Tensor],
    most: int,
    *,
    group: dist.ProcessGroup,
    statistics: TokenStatistics | None,
) -> torch.Tensor:
    """Steps 2-3 of the module docstring: the head on this rank's chunk ``hidden`` ``[T / cp, hidden]`` at its
    held output positions (an LM head's logits through ``statistics``), every rank's gathered in row order
    (``reads``: ``ContextRow.gather_inputs`` on the device)."""
    outputs = model.head_outputs(hidden.index_select(0, reads["held"]))
    if statistics is not None:
        outputs = statistics(outputs, reads["labels"])
    gathered = gather_rows(outputs, most, reads["keep"], group)
    return gathered.index_select(0, reads["order"]) if "order" in reads else gathered  # zig-zag: out of row order


def context_parallel_pipeline(
    pipeline: Pipeline,
    rows: list[ContextRow],
    steps: list[tuple[int, int]],
    micros: list[PackedRows],
    output_fn: Callable[[torch.Tensor, PackedRows], torch.Tensor],
    *,
    group: dist.ProcessGroup,
    train: bool,
    statistics: TokenStatistics | None = None,
) -> list[torch.Tensor]:
    """The group's micro-batches ``rows`` (``schedule`` order, ``steps`` naming each one's (owner, index)) through
    ``pipeline``, every rank of each stage its chunk of each row: rows padded to common shapes (``padded_to``; a
    schedule needs them), each stage's decoder layers on the chunks (``DecoderLM.forward`` with ``row_length`` hands
    hidden states on), and on the last stage steps 2-4 of the module docstring per micro-batch: the head on this
    rank's chunk, its per-token outputs gathered over ``group``, ``output_fn`` on the owner of this rank's
    ``micros``. Returns the results of this rank's own micro-batches (the last stage's; none elsewhere), detached."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    unit = (2 * cp if rows[0].zigzag else cp) * pipeline.module.sequence_parallel  # chunks that tp splits evenly
    offsets = max(len(row.cu_seqlens) for row in rows) + 1
    length = max(len(row.input_ids) + offsets - len(row.cu_seqlens) for row in rows)
    length += -length % unit
    rows = [row.padded_to(length, offsets) for row in rows]
    chunks = [row.chunk(rank, cp) for row in rows]
    kwargs = {
        "position_ids": torch.stack([chunk[1] for chunk in chunks]),
        "cu_seqlens": torch.stack([row.cu_seqlens for row in rows]),
        "row_length": length,
    }
    model = pipeline.module
    host_inputs = [{"max_seqlen": row.max_seqlen, "length_classes": row.length_classes(model)} for row in rows]
    reads = []
    if pipeline.is_last:
        for row in rows:
            on_host, most = row.gather_inputs(rank, cp, labels=statistics is not None)
            reads.append((to_device_together(on_host, pipeline.device), most))

    def stage_output(hidden: torch.Tensor, index: int) -> torch.Tensor:
        owner, mine = steps[index]
        gathered = _gathered_outputs(model, hidden[0], *reads[index], group=group, statistics=statistics)
        if owner != rank:
            return gathered[:0].sum()  # as in context_parallel_step
        return output_fn(gathered, micros[mine])

    input_ids = torch.stack([chunk[0] for chunk in chunks])
    results = pipeline.run(input_ids, kwargs, output_fn=stage_output, train=train, host_inputs=host_inputs)
    return [result.detach() for result, (owner, _) in zip(results, steps) if owner == rank]


def gather_chunk_routes(chunk: torch.Tensor, row: ContextRow, group: dist.ProcessGroup) -> torch.Tensor:
    """The experts every rank of ``group`` routed its chunk of ``row`` to (``chunk`` ``[T / cp, moe_layers, k]`` on
    this rank) as the row's ``[T - padding, moe_layers, k]`` in row order, on every rank (router replay's record)."""
    cp = dist.get_world_size(group)
    pieces = [torch.empty_like(chunk, dtype=torch.int32) for _ in range(cp)]
    dist.all_gather(pieces, chunk.to(torch.int32).contiguous(), group=group)
    order = torch.argsort(torch.cat([row.positions(rank, cp) for rank in range(cp)]))
    row_order = torch.cat(pieces).index_select(0, to_device(order, chunk.device))
    return row_order[: len(row.input_ids) - row.padding_tokens].to(chunk.dtype)


class ContextParallelRunner:
    """One role's micro-batches under context parallelism over ``group``, for ``ShardedModel.run_model``: the rows
    exchanged once per call (``rows``), each micro-batch of the group run by every rank (``step``), or through a
    pipeline (``context_parallel_pipeline``); with router replay, each rank's routers take its chunk's recorded
    experts, and a recording gathers the chunks' experts back for the row's owner."""

    def __init__(
        self, model: torch.nn.Module, group: dist.ProcessGroup, *, replay: RouterReplay | None, device: torch.device
    ) -> None:
        self.model, self.group, self.replay, self.device = model, group, replay, device
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.padding_tokens = 0
        """Padding tokens this rank's micro-batches took so that cp divides their packed rows, since the start (a
        metric: ``<role>/cp_padding_tokens``)."""

    def rows(self, micros: list[PackedRows], *, per_token: bool) -> list[list[ContextRow]]:
        """Every rank of the group's micro-batch rows, by group rank (``exchange_rows``), laid out for the model's
        attention (zig-zag chunks for ring)."""
        replay, zigzag = self.replay, self.model.context_parallel == "ring"
        mine = [
            ContextRow.of(
                micro,
                cp=self.cp,
                per_token=per_token,
                zigzag=zigzag,
                routes=None if replay is None else replay.packed_routes(micro),
                multiple=self.model.sequence_parallel,
            )
            for micro in micros
        ]
        self.padding_tokens += sum(row.padding_tokens for row in mine)
        return exchange_rows(mine, self.group)

    def step(
        self,
        row: ContextRow,
        micro: PackedRows | None,
        output_fn: Callable[[torch.Tensor, PackedRows], torch.Tensor],
        *,
        train: bool,
        statistics: TokenStatistics | None,
        every_rank: Callable[[ContextRow, torch.Tensor], torch.Tensor | None] | None,
    ) -> torch.Tensor | None:
        """``context_parallel_step`` of ``row`` (``micro``: this rank's, if it owns the row), routing by the row's
        recorded experts where it carries them."""
        routes = None if self.replay is None else row.chunk_routes(self.rank, self.cp)
        with self.replay.replaying_routes(routes, self.device) if routes is not None else contextlib.nullcontext():
            return context_parallel_step(
                self.model,
                row,
                micro,
                output_fn,
                group=self.group,
                device=self.device,
                train=train,
                statistics=statistics,
                every_rank=self._after_recording(every_rank),
            )

    def _after_recording(
        self, every_rank: Callable[[ContextRow, torch.Tensor], torch.Tensor | None] | None
    ) -> Callable[[ContextRow, torch.Tensor], torch.Tensor | None] | None:
        """``every_rank``, after router replay's recording (if on) has gathered the row's experts from the group's
        chunks: the owner's ``routes_of`` then reads the whole row's."""
        replay = self.replay
        if replay is None or replay.seen is None:
            return every_rank

        def gather_then(row: ContextRow, real_tokens: torch.Tensor) -> torch.Tensor | None:
            whole = gather_chunk_routes(replay.recorded_chunk(), row, self.group)
            replay.seen[:] = whole.unbind(1)
            return None if every_rank is None else every_rank(row, real_tokens)

        return gather_then
