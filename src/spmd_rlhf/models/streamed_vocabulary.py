"""Vocabulary weights (an embedding, an LM head, or a tied pair) that stay sharded over the data-parallel ranks,
gathered and reduced one chunk of rows at a time.

Under FSDP2 a vocabulary weight is gathered whole for its unit's forward and its whole gradient made unsharded before
the reduce-scatter copies it once more into its own buffer (cast to float32 first, under a bf16 policy). A tied
weight is worse off: it belongs to the root unit, used at both ends of the forward, so it stays gathered from the
embedding to the end of the backward and its gradient sums the head's and the embedding's. At Qwen2.5-0.5B's shape
(tied) that is three ``[vocab, hidden]`` tensors (1.5 GiB in float32) on every rank, for 136 M of the model's 494 M
parameters; at Qwen2.5-7B's (untied) each of the two matrices is 545 M parameters.

Here the weight is a DTensor sharded by rows over the dp mesh, the layout FSDP2 gives its own parameters (so the
optimizer, DCP checkpoints, gradient clipping, the weight sync and the Hugging Face export read it as any other),
and FSDP leaves it out (``ignored_params``). Rank ``r`` holds rows ``[r * band, (r + 1) * band)`` (``band`` =
``ceil(vocab / dp)``; DTensor's uneven ``Shard(0)``). One step of a pass takes rows ``[start, start + count)`` of
every rank's shard: one all-gather of ``dp * count`` rows in the compute dtype, used and dropped; in the backward,
the gradient of the same rows is reduce-scattered back to their owners and averaged over dp, as FSDP2 averages.
Under HSDP (a 2-D ``("dp_replicate", "dp_shard")`` mesh) all of this runs within the shard group, the weight
replicated across the groups, and each reduced gradient is all-reduced across them before the average.

- Head: each step computes the logits of its rows for every position. Its backward gathers the rows again for the
  hidden states' gradient, and reduce-scatters the rows' gradient ``grad_logits[:, rows].T @ hidden``.
- Embedding: when every rank's tokens together take no more room than one step's rows (a micro-batch of up to
  ``rows_per_step`` tokens per rank: 9,362 at 0.5B on 2 ranks in float32), it moves tokens, not rows: the ids are
  all-gathered, each rank looks up the rows it holds, and a reduce-scatter puts each token's row in place; the
  backward all-gathers the tokens' gradients and each rank adds those of its own rows. Otherwise it runs the steps
  of rows: each fills the hidden states of the tokens whose rows it gathered, and its backward adds each token's
  gradient into its row of the step's rows and reduce-scatters them.

At peak a pass holds one step's gathered rows and their gradient (``chunk_bytes`` each), never the whole vocabulary.
The price is communication: per micro-batch the head all-gathers the weight twice and reduce-scatters it once (and
the embedding, past its tokens' bound, once more each), where FSDP's root gathers it once and reduce-scatters once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from spmd_rlhf.collectives import all_gather_flat, reduce_scatter_flat

DEFAULT_CHUNK_BYTES = 64 * 1024**2
"""Bytes of one step's gathered rows (every rank's part together) in the compute dtype."""


@dataclass
class VocabularyStream:
    """How a ``[rows, hidden]`` weight sharded by rows over ``group`` is streamed: the steps' row ranges within each
    rank's shard, the dtype rows are gathered in, and the dtype gradients are reduced in."""

    rows: int
    hidden: int
    ranks: int
    rank: int
    group: dist.ProcessGroup
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    rows_per_step: int
    replica_group: dist.ProcessGroup | None = None
    """HSDP: the group of the ranks holding this rank's shard in the other replicas, across which a gradient summed
    over ``group`` is all-reduced; None with one replica."""
    replicas: int = 1
    defer_replica_reduce: bool = False
    """Set while a call's micro-batches run (``training.fsdp_schedule``): each backward's reduced gradient is summed
    into the sharded gradient without the all-reduce across replicas, which ``all_reduce_across_replicas`` then runs
    once on the sum."""

    @property
    def band(self) -> int:
        """Rows of a full shard (the last ranks' may be shorter, or empty)."""
        return -(-self.rows // self.ranks)

    def steps(self) -> list[tuple[int, int]]:
        """``(start, count)`` of each step's rows within every rank's shard."""
        return [
            (start, min(self.rows_per_step, self.band - start)) for start in range(0, self.band, self.rows_per_step)
        ]

    def owner_and_offset(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank whose shard holds each id's row, and the row's place in that shard."""
        return torch.div(ids, self.band, rounding_mode="floor"), ids % self.band

    def gather_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Every rank's ``ids`` (all of one length), end to end."""
        every_id = ids.new_empty(self.ranks * ids.shape[0])
        all_gather_flat(every_id, ids.contiguous(), group=self.group)
        return every_id

    def held_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Which ``ids`` (-1: padding) fall in this rank's shard, and their rows there (0 for the others)."""
        owner, offset = self.owner_and_offset(ids)
        mine = (ids >= 0) & (owner == self.rank)
        return mine, torch.where(mine, offset, 0)

    def gather(self, shard: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` of every rank's shard, ``[ranks, count, hidden]`` in the compute dtype
        (zeros past a shorter shard's end)."""
        piece = shard[start : start + count].to(self.compute_dtype)
        if piece.shape[0] < count:
            piece = F.pad(piece, (0, 0, 0, count - piece.shape[0]))
        gathered = piece.new_empty(self.ranks * count, self.hidden)
        all_gather_flat(gathered, piece.contiguous(), group=self.group)
        return gathered.view(self.ranks, count, self.hidden)

    def reduce_into(self, rows_grad: torch.Tensor, grad_shard: torch.Tensor, start: int, count: int) -> None:
        """Reduce-scatter the gradient of every rank's rows ``[start, start + count)`` (``[ranks * count, hidden]``)
        and write this rank's mean over dp into those rows of ``grad_shard``."""
        mine = rows_grad.new_empty(count, self.hidden, dtype=self.reduce_dtype)
        reduce_scatter_flat(mine, rows_grad.to(self.reduce_dtype).contiguous(), group=self.group)
        held = grad_shard[start : start + count]
        held.copy_(self.mean_over_dp(mine)[: held.shape[0]])

    def mean_over_dp(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad``, summed over this rank's shard group, made the mean over every DP rank in place: all-reduced
        across the replicas first (HSDP), then divided by dp, as FSDP averages."""
        if self.replica_group is not None and not self.defer_replica_reduce:
            dist.all_reduce(grad, group=self.replica_group)
        return grad.div_(self.ranks * self.replicas)

    def all_reduce_across_replicas(self, grad: torch.Tensor) -> None:
        """The deferred all-reduce (``defer_replica_reduce``) of a weight's sharded gradient, in place: the sum over
        the replicas of what each summed from its micro-batches, already divided by dp."""
        if self.replica_group is not None:
            dist.all_reduce(grad, group=self.replica_group)

    def gather_into(self, shard: torch.Tensor, whole: torch.Tensor) -> None:
        """Copy the whole weight into ``whole`` ``[rows, hidden]`` (a copy of the model that holds it whole): one
        all-gather, straight into ``whole`` when it is contiguous in the compute dtype and the split is even, else
        through a buffer of the whole weight (as FSDP's unit gathered whole)."""
        piece = shard.to(self.compute_dtype)
        if piece.shape[0] < self.band:
            piece = F.pad(piece, (0, 0, 0, self.band - piece.shape[0]))
        direct = whole.is_contiguous() and whole.dtype == self.compute_dtype and self.rows == self.ranks * self.band
        gathered = whole if direct else piece.new_empty(self.ranks * self.band, self.hidden)
        all_gather_flat(gathered, piece.contiguous(), group=self.group)
        if not direct:
            whole.copy_(gathered[: self.rows])


class _Embedding(torch.autograd.Function):
    """``out[t] = weight[ids[t]]``; gradient w.r.t. the shard: each token's gradient added into its row.

    Two ways, the cheaper in bytes moved, the same on every rank: when every rank's tokens together take no more room
    than one step's rows, by tokens (the ids are all-gathered, each rank looks up the rows it owns, and a
    reduce-scatter of the looked-up rows sums each token's one owner's row into place; the backward all-gathers
    the tokens' gradients and each rank adds those of its rows); otherwise by the steps of rows."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, shard: torch.Tensor, stream: VocabularyStream) -> torch.Tensor:
        # The most tokens any rank holds, agreed on the host (the groups take host tensors through gloo beside NCCL,
        # as the metrics' reductions do): no copy to the device and no read back, which waited for it per forward.
        most_tokens = torch.tensor([ids.shape[0]])
        dist.all_reduce(most_tokens, op=dist.ReduceOp.MAX, group=stream.group)
        most_tokens = int(most_tokens)
        ctx.stream, ctx.shard_shape, ctx.shard_dtype, ctx.tokens = stream, shard.shape, shard.dtype, ids.shape[0]
        ctx.by_tokens = most_tokens <= stream.rows_per_step
        if ctx.by_tokens:
            every_id = stream.gather_tokens(F.pad(ids, (0, most_tokens - ids.shape[0]), value=-1))
            mine, offset = stream.held_rows(every_id)
            rows = torch.zeros(mine.shape[0], stream.hidden, dtype=stream.compute_dtype, device=ids.device)
            if shard.shape[0]:  # past an uneven split a rank holds no rows
                rows = torch.where(mine[:, None], shard[offset].to(stream.compute_dtype), rows)
            out = rows.new_empty(most_tokens, stream.hidden)
            reduce_scatter_flat(out, rows, group=stream.group)
            ctx.save_for_backward(mine, offset)
            return out[: ids.shape[0]]
        owner, offset = stream.owner_and_offset(ids)
        out = torch.zeros(ids.shape[0], stream.hidden, dtype=stream.compute_dtype, device=ids.device)
        for start, count in stream.steps():
            rows = stream.gather(shard, start, count)
            local = offset - start
            hit = (local >= 0) & (local < count)
            out = torch.where(hit[:, None], rows[owner, local.clamp(0, count - 1)], out)
        ctx.save_for_backward(owner, offset)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None, None
        stream = ctx.stream
        if ctx.by_tokens:
            mine, offset = ctx.saved_tensors
            most_tokens = mine.shape[0] // stream.ranks
            grad_out = F.pad(grad_out.to(stream.reduce_dtype), (0, 0, 0, most_tokens - ctx.tokens))
            every_grad = grad_out.new_empty(mine.shape[0], stream.hidden)
            all_gather_flat(every_grad, grad_out.contiguous(), group=stream.group)
            grad_shard = torch.zeros(ctx.shard_shape, dtype=stream.reduce_dtype, device=grad_out.device)
            if grad_shard.shape[0]:
                grad_shard.index_add_(0, offset, torch.where(mine[:, None], every_grad, 0))
            return None, stream.mean_over_dp(grad_shard).to(ctx.shard_dtype), None
        owner, offset = ctx.saved_tensors
        grad_shard = grad_out.new_empty(ctx.shard_shape, dtype=ctx.shard_dtype)
        for start, count in stream.steps():
            local = offset - start
            hit = (local >= 0) & (local < count)
            rows_grad = grad_out.new_zeros(stream.ranks * count, stream.hidden, dtype=stream.reduce_dtype)
            contribution = torch.where(hit[:, None], grad_out, 0).to(stream.reduce_dtype)
            rows_grad.index_add_(0, owner * count + local.clamp(0, count - 1), contribution)
            stream.reduce_into(rows_grad, grad_shard, start, count)
        return None, grad_shard, None


class _Head(torch.autograd.Function):
    """``logits = hidden @ weight.T``; gradients ``grad_logits @ weight`` and ``grad_logits.T @ hidden``, one step's
    rows at a time."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, shard: torch.Tensor, stream: VocabularyStream) -> torch.Tensor:
        logits = hidden.new_empty(hidden.shape[0], stream.ranks, stream.band, dtype=stream.compute_dtype)
        for start, count in stream.steps():
            rows = stream.gather(shard, start, count).view(-1, stream.hidden)
            logits[:, :, start : start + count] = (hidden @ rows.T).view(-1, stream.ranks, count)
        ctx.save_for_backward(hidden, shard)
        ctx.stream = stream
        return logits.view(hidden.shape[0], stream.ranks * stream.band)[:, : stream.rows]  # 0 rows too

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor):
        hidden, shard = ctx.saved_tensors
        stream = ctx.stream
        padding = stream.ranks * stream.band - stream.rows
        grad_logits = F.pad(grad_logits, (0, padding)) if padding else grad_logits.contiguous()
        grad_logits = grad_logits.view(-1, stream.ranks, stream.band)
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
        )
        grad_shard = shard.new_empty(shard.shape) if ctx.needs_input_grad[1] else None
        for start, count in stream.steps():
            step_grad = grad_logits[:, :, start : start + count].reshape(-1, stream.ranks * count)
            if grad_hidden is not None:
                rows = stream.gather(shard, start, count).view(-1, stream.hidden)
                grad_hidden += (step_grad @ rows).float()
                del rows
            if grad_shard is not None:
                stream.reduce_into(step_grad.T @ hidden, grad_shard, start, count)
        return None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_shard, None


def _shard(weight: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``weight`` as a DTensor sharded by rows over ``mesh``'s last dimension (DTensor's uneven ``Shard(0)`` chunks,
    as FSDP2 lays out its own parameters) and replicated over the first of a 2-D HSDP mesh; this rank keeps only its
    rows. Works on the meta device."""
    band = -(-weight.shape[0] // mesh.size(-1))
    start = min(mesh.get_local_rank(mesh.ndim - 1) * band, weight.shape[0])
    local = weight.detach()[start : start + band].clone()
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=weight.shape, stride=weight.stride())


def _embed(module: nn.Embedding, stream: VocabularyStream, ids: torch.Tensor) -> torch.Tensor:
    out = _Embedding.apply(ids.reshape(-1), module.weight.to_local(), stream)
    return out.view(*ids.shape, stream.hidden)


def _project(module: nn.Linear, stream: VocabularyStream, hidden: torch.Tensor) -> torch.Tensor:
    logits = _Head.apply(hidden.reshape(-1, stream.hidden).to(stream.compute_dtype), module.weight.to_local(), stream)
    return logits.view(*hidden.shape[:-1], stream.rows)


def stream_vocabulary(
    modules: list[nn.Embedding | nn.Linear],
    mesh: DeviceMesh,
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
) -> nn.Parameter:
    """Shard the ``[vocab, hidden]`` weight ``modules`` share (an embedding, an LM head, or a tied pair of them) by
    rows over the 1-D ``mesh``, or over the shard dimension of a 2-D ``("dp_replicate", "dp_shard")`` HSDP mesh
    (replicated over the other, the gradients all-reduced across it), and make each module stream it (see the module
    docstring); returns the new parameter,
    which every module holds, for FSDP's ``ignored_params``. ``compute_dtype`` (rows are gathered and used in it) and
    ``reduce_dtype`` default to the weight's dtype; ``chunk_bytes``, the size of one step's gathered rows, to
    ``DEFAULT_CHUNK_BYTES``."""
    weight = modules[0].weight
    if any(module.weight is not weight for module in modules):
        raise ValueError("stream_vocabulary takes modules that share one weight (an embedding tied to its LM head)")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"stream_vocabulary takes a 1-D dp mesh or a 2-D HSDP mesh, not {mesh.ndim}-D")
    rows, hidden = weight.shape
    compute_dtype = compute_dtype or weight.dtype
    shards = mesh.size(-1)
    per_row = shards * hidden * torch.empty((), dtype=compute_dtype).element_size()
    stream = VocabularyStream(
        rows=rows,
        hidden=hidden,
        ranks=shards,
        rank=mesh.get_local_rank(mesh.ndim - 1),
        group=mesh.get_group(mesh.ndim - 1),
        compute_dtype=compute_dtype,
        reduce_dtype=reduce_dtype or compute_dtype,
        rows_per_step=max(1, (chunk_bytes or DEFAULT_CHUNK_BYTES) // per_row),
        replica_group=mesh.get_group(0) if mesh.ndim == 2 else None,
        replicas=mesh.size(0) if mesh.ndim == 2 else 1,
    )
    parameter = nn.Parameter(_shard(weight, mesh), requires_grad=weight.requires_grad)
    for module in modules:
        module.weight = parameter
        module.forward = functools.partial(_embed if isinstance(module, nn.Embedding) else _project, module, stream)
        module.vocabulary_stream = stream
    return parameter


def vocabulary_stream(module: nn.Module) -> VocabularyStream | None:
    """The stream of a module made to stream its weight by ``stream_vocabulary``, else None."""
    return getattr(module, "vocabulary_stream", None)
