"""A long packed row's sequences attended per length class, as one opaque operator.

A packed row over ``attention.MASK_TOKEN_LIMIT`` tokens never attends under one ``[total, total]`` mask: its
sequences run as right-padded rows, grouped by power-of-two length class so that no sequence is padded to more than
twice its length. How many classes a row spans changes with its sequences' lengths, so a compiled decoder block that
looped over them would recompile for every new count (session 49's H200 run: every block, about 8 s each time, in
the reference and the update of an RL step). Here the classes are described by tensors of the row's length (which a
block compiled with ``dynamic=True`` sees as symbolic) and a small host tensor of the classes' sizes, and the
attention runs in ``spmd_rlhf::length_bucketed_attention``, a ``torch.library`` operator that TorchDynamo keeps whole:
one graph per block however many classes a row spans. Its backward is an operator too, which runs the forward again
under autograd (one attention forward more per layer in training; it keeps only q, k, v, not the padded copies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

LENGTH_CLASSES = 64
"""Power-of-two length classes a packed row's sequences can fall in (lengths below 2**63)."""


@dataclass(frozen=True)
class LengthBuckets:
    """A packed row of ``total`` tokens as right-padded rows per length class, laid end to end in class order."""

    places: torch.Tensor
    """``[4, total]``: for each place in class order, the packed row's token there, that token's row in its class's
    padded rows and its position in that row; then for each packed token, where its output lies among the classes'
    outputs laid end to end."""
    sizes: torch.Tensor
    """Host ``[LENGTH_CLASSES, 3]``: each class's padded rows, their length and its tokens (zeros past the last
    class: a shape that never changes, so a compiled block never guards on how many classes there are)."""

    @property
    def total(self) -> int:
        """The packed row's tokens."""
        return self.places.shape[1]


@dataclass(frozen=True)
class OneLengthClass:
    """A packed row of ``total`` tokens whose sequences all fall in one length class: one padded batch serves. Said
    by whoever grouped them on the host (a packer), so that the model need not read the offsets back to find it."""

    total: int


def places_to_move(classes: LengthBuckets | OneLengthClass | None, key: str) -> dict[str, torch.Tensor]:
    """``{key: places}`` of a long row's rows per class, to move to the device with a pass's other inputs in one
    copy (``data.batch.to_device_together``); nothing for one class or none."""
    return {key: classes.places} if isinstance(classes, LengthBuckets) else {}


def with_places_moved(
    classes: LengthBuckets | OneLengthClass | None, moved: dict[str, torch.Tensor], key: str
) -> LengthBuckets | OneLengthClass | None:
    """``classes`` with their index tensor the one moved under ``key`` (``places_to_move``)."""
    return replace(classes, places=moved[key]) if key in moved else classes


def length_buckets(cu_seqlens: torch.Tensor, total: int) -> LengthBuckets | OneLengthClass:
    """The sequences of a packed row of ``total`` tokens (offsets ``cu_seqlens``) grouped by power-of-two length
    class, or ``OneLengthClass`` when they all fall in one. Reads the offsets on the host: one copy per forward
    where they are on the device."""
    device = cu_seqlens.device
    offsets = cu_seqlens.cpu().long()
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    classes = torch.where(lengths > 1, torch.log2((lengths - 1).clamp(min=1).double()).floor().long() + 1, 0)
    tokens, rows, columns, sizes = [], [], [], []
    for length_class in classes[lengths > 0].unique().tolist():
        members = ((classes == length_class) & (lengths > 0)).nonzero().flatten()
        member_lengths = lengths[members]
        member_rows = torch.repeat_interleave(torch.arange(len(members)), member_lengths)
        first = torch.repeat_interleave(member_lengths.cumsum(0) - member_lengths, member_lengths)
        member_columns = torch.arange(int(member_lengths.sum())) - first
        tokens.append(starts[members][member_rows] + member_columns)
        rows.append(member_rows)
        columns.append(member_columns)
        sizes.append((len(members), int(member_lengths.max()), len(member_rows)))
    if len(sizes) < 2:
        return OneLengthClass(total)
    table = torch.zeros(LENGTH_CLASSES, 3, dtype=torch.long)
    table[: len(sizes)] = torch.tensor(sizes, dtype=torch.long)
    torch._dynamo.mark_static(table)  # no symbolic sizes, hence no guard relating them to the row's
    placed = torch.cat(tokens)
    order = torch.empty(total, dtype=torch.long)
    order[placed] = torch.arange(total)
    places = torch.stack([placed, torch.cat(rows), torch.cat(columns), order])
    return LengthBuckets(places=places.to(device), sizes=table)


def bucketed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: LengthBuckets, backend: str, scale: float
) -> torch.Tensor:
    """Causal attention of packed sequences ``q`` ``[1, total, heads, d]`` over ``k, v`` ``[1, total, kv_heads, d]``
    per length class of ``buckets``; returns ``[1, total, heads, d]``."""
    return torch.ops.spmd_rlhf.length_bucketed_attention(q, k, v, buckets.places, buckets.sizes, backend, scale)


def _attend_per_class(q, k, v, places, sizes, backend, scale) -> torch.Tensor:
    """The operator's work, eagerly: each class's tokens scattered into right-padded rows, plain causal attention over
    them (a right-padded row's real queries see only real keys), the outputs gathered back into the packed order. The
    class table is on the host, so nothing here waits for the device."""
    from spmd_rlhf.models.attention import _dense_attention  # attention imports this module

    tokens, rows, columns, order = places
    outputs, start = [], 0
    for class_rows, length, count in sizes.tolist():
        if count == 0:
            break
        picked = tokens[start : start + count]
        slots = (rows[start : start + count], columns[start : start + count])
        start += count

        def padded(tensor: torch.Tensor) -> torch.Tensor:
            zeros = tensor.new_zeros(class_rows, length, *tensor.shape[2:])
            return zeros.index_put(slots, tensor[0].index_select(0, picked)).transpose(1, 2)

        out = _dense_attention(padded(q), padded(k), padded(v), None, backend, scale)
        outputs.append(out.transpose(1, 2)[slots])
    return torch.cat(outputs).index_select(0, order)[None]


@torch.library.custom_op("spmd_rlhf::length_bucketed_attention", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    places: torch.Tensor,
    sizes: torch.Tensor,
    backend: str,
    scale: float,
) -> torch.Tensor:
    return _attend_per_class(q, k, v, places, sizes, backend, scale)


@_forward.register_fake
def _(q, k, v, places, sizes, backend, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Autograd back on inside an operator's kernel, which the dispatcher runs below autograd: the backward below
    records the forward it runs again, then differentiates it."""
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in keys]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, was in zip(keys, excluded):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


@torch.library.custom_op("spmd_rlhf::length_bucketed_attention_backward", mutates_args=())
def _backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    places: torch.Tensor,
    sizes: torch.Tensor,
    backend: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad(), _autograd_dispatch():
        inputs = [tensor.detach().requires_grad_() for tensor in (q, k, v)]
        out = _attend_per_class(*inputs, places, sizes, backend, scale)
        dq, dk, dv = torch.autograd.grad(out, inputs, grad)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()  # the strides register_fake promises


@_backward.register_fake
def _(grad, q, k, v, places, sizes, backend, scale):
    return tuple(torch.empty_like(tensor, memory_format=torch.contiguous_format) for tensor in (q, k, v))


def _keep_inputs(ctx, inputs, output) -> None:
    q, k, v, places, sizes, backend, scale = inputs
    ctx.save_for_backward(q, k, v, places, sizes)
    ctx.backend, ctx.scale = backend, scale


def _gradients(ctx, grad: torch.Tensor):
    dq, dk, dv = _backward(grad.contiguous(), *ctx.saved_tensors, ctx.backend, ctx.scale)
    return dq, dk, dv, None, None, None, None


_forward.register_autograd(_gradients, setup_context=_keep_inputs)
