"""Router replay's record in the engine: which experts every token of every request was routed to, per MoE layer.

A route cache ``[moe_layers, slots, k]`` (int8 up to 127 experts, else int16) lies beside the KV cache, one entry per
KV slot: each step's forward hooks write the experts of its new tokens at their slots (``slot_mapping``), so tokens
of shared prefix blocks, computed once for all the samples of a prompt, are there for every sample too. After the
step each sequence's new entries (every token of a prefill, prefix included; the last token of a decode) are read
back to the host with the step's logits, into ``Sequence.routed_experts``. Decode steps run eagerly while recording
(the hooks are Python).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from spmd_rlhf.engine.sequence import Sequence
from spmd_rlhf.models.decoder import DecoderLM
from spmd_rlhf.models.moe import Routing, route_dtype


class RouteRecorder:
    """The route cache of one ``ModelRunner`` over ``model`` (every MoE layer on this rank)."""

    def __init__(self, model: DecoderLM, *, block_size: int) -> None:
        moe = model.args.moe
        if moe is None:
            raise ValueError("router replay records the experts of a mixture-of-experts model; this model is dense")
        self.routers = [model.model.layers[str(index)].mlp.gate for index in sorted(moe.layers)]
        self.dtype, self.top_k, self.block_size = route_dtype(moe.num_experts), moe.num_experts_per_tok, block_size
        self.cache: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None

    def allocate(self, num_blocks: int, device: torch.device) -> None:
        self.cache = torch.full(
            (len(self.routers), num_blocks * self.block_size, self.top_k), -1, dtype=self.dtype, device=device
        )

    def free(self) -> None:
        self.cache = None

    @contextmanager
    def recording(self, slot_mapping: torch.Tensor) -> Iterator[None]:
        """Inside, each router's forward writes its choices at ``slot_mapping`` (the step's new tokens' slots)."""
        self._slots = slot_mapping
        handles = [
            router.register_forward_hook(functools.partial(self._write, j)) for j, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._slots = None

    def _write(self, layer: int, module: torch.nn.Module, inputs: object, routing: Routing) -> None:
        self.cache[layer].index_copy_(0, self._slots, routing.experts.to(self.dtype))

    def collect(self, seqs: list[Sequence], *, is_prefill: bool) -> None:
        """Each sequence's routes of this step, read back in one copy: a prefill's replace what a preempted run had."""
        positions = [range(len(seq)) if is_prefill else range(len(seq) - 1, len(seq)) for seq in seqs]
        slots = [
            seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
            for seq, span in zip(seqs, positions)
            for p in span
        ]
        read = self.cache.index_select(1, torch.tensor(slots, device=self.cache.device)).transpose(0, 1).cpu()
        for seq, piece in zip(seqs, read.split([len(span) for span in positions])):
            if is_prefill:
                seq.routed_experts = [piece]
            else:
                seq.routed_experts.append(piece)


def rollout_routes(seqs: list[Sequence], *, prompt_width: int, response_width: int) -> torch.Tensor:
    """The engine's records of ``seqs`` (``Sequence.routed_experts``) in the rollout layout: prompts left-padded to
    ``prompt_width``, responses right-padded to ``response_width``, -1 where nothing was recorded."""
    first = seqs[0].routed_experts[0]
    routes = torch.full((len(seqs), prompt_width + response_width, *first.shape[1:]), -1, dtype=first.dtype)
    for row, seq in enumerate(seqs):
        recorded = torch.cat(seq.routed_experts)
        prompt = seq.num_prompt_tokens
        routes[row, prompt_width - prompt : prompt_width] = recorded[:prompt]
        routes[row, prompt_width : prompt_width + len(recorded) - prompt] = recorded[prompt:]
    return routes
