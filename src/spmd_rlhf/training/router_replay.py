"""Router replay (``algorithm.router_replay``): the training forward of a mixture-of-experts actor routes each token to
the experts recorded for it instead of its router's own top-k.

The record travels with the rollout rows as ``routed_experts`` ``[rows, P + R, moe_layers, k]`` (int8 up to 127
experts, else int16; -1 where nothing was recorded: padding, and the last generated token, which the engine never
feeds back), aligned with ``input_ids``. ``rollout`` (R3) records it in the generation engine (``engine.routes``,
laid out by its ``rollout_routes``); ``recompute`` (R2) in the actor's old-policy log-prob pass
(``RouterReplay.recording``).
A micro-batch whose rows carry it is run inside ``RouterReplay.replaying``: each router gets its layer's ids for the
packed tokens (``TopKRouter.replay``) for the forward and the backward (an activation-checkpointing recompute replays
too), and computes its weights as its own probabilities at those experts, so the router still gets gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from spmd_rlhf.data.batch import to_device
from spmd_rlhf.models.args import DecoderArgs
from spmd_rlhf.models.moe import route_dtype
from spmd_rlhf.training.packing import MicroBatch

ROUTED_EXPERTS = "routed_experts"
"""The batch field of the recorded experts (module docstring)."""


def check_router_replay(mode: str, args: DecoderArgs) -> None:
    """Refuse router replay on a dense model, naming the key."""
    if mode != "off" and args.moe is None:
        raise ValueError(
            f"algorithm.router_replay={mode} replays the experts of a mixture-of-experts model, but {args.family} is "
            "dense; set algorithm.router_replay=off"
        )


class RouterReplay:
    """The MoE routers of one model (a pipeline stage's), by their place among the model's MoE layers."""

    def __init__(self, model: nn.Module) -> None:
        moe = model.args.moe
        layers = model.model.layers
        self.routers = {
            place: layers[str(index)].mlp.gate for place, index in enumerate(sorted(moe.layers)) if str(index) in layers
        }
        self.dtype = route_dtype(moe.num_experts)
        self.seen: list[torch.Tensor | None] | None = None
        """While ``recording``: each MoE layer's chosen experts of the last forward."""

    @contextmanager
    def replaying(self, micro: MicroBatch, device: torch.device) -> Iterator[None]:
        """Inside, the routers route ``micro``'s packed tokens by its rows' ``routed_experts``, if they carry them."""
        with self.replaying_routes(self.packed_routes(micro), device):
            yield

    @staticmethod
    def packed_routes(micro: MicroBatch) -> torch.Tensor | None:
        """The recorded experts of ``micro``'s packed tokens ``[tokens, moe_layers, k]`` (or None)."""
        if ROUTED_EXPERTS not in micro.rows.tensors:
            return None
        return micro.rows[ROUTED_EXPERTS][micro.rows["attention_mask"].bool()]

    @contextmanager
    def replaying_routes(self, routes: torch.Tensor | None, device: torch.device) -> Iterator[None]:
        """Inside, the routers route the next forwards' tokens by ``routes`` ``[tokens, moe_layers, k]`` (nothing
        changes for None)."""
        if routes is None:
            yield
            return
        packed = to_device(routes, device)  # pinned, without blocking the host
        for place, router in self.routers.items():
            router.replay = packed[:, place]
        try:
            yield
        finally:
            for router in self.routers.values():
                router.replay = None

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor | None]]:
        """Inside, each forward's chosen experts are kept in the yielded list (one ``[tokens, k]`` slot per MoE layer,
        cleared by ``routes_of``), also ``self.seen`` while it lasts."""
        seen: list[torch.Tensor | None] = [None] * len(self.routers)
        handles = [
            router.register_forward_hook(
                lambda module, inputs, routing, slot=slot: seen.__setitem__(slot, routing.experts)
            )
            for slot, router in enumerate(self.routers.values())
        ]
        self.seen = seen
        try:
            yield seen
        finally:
            self.seen = None
            for handle in handles:
                handle.remove()

    def recorded_chunk(self) -> torch.Tensor:
        """The experts of the last forward while ``recording`` ``[tokens, moe_layers, k]``, in the record's dtype."""
        return torch.stack(self.seen, dim=1).to(self.dtype)

    def routes_of(self, seen: list[torch.Tensor | None], micro: MicroBatch) -> torch.Tensor:
        """The experts of ``micro``'s last forward (``recording``) as ``routed_experts`` rows, on the host."""
        attended = micro.rows["attention_mask"].bool()
        packed = torch.stack(seen, dim=1).to("cpu", self.dtype)
        seen[:] = [None] * len(seen)
        routes = torch.full((*attended.shape, *packed.shape[1:]), -1, dtype=self.dtype)
        routes[attended] = packed
        return routes
