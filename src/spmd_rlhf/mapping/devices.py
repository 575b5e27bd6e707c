"""The devices a plan places roles on (``Cluster``: how many, how they group into nodes, what each can do, and what
a collective over some of them costs) and a role's parallel layout on its devices (``Layout``), as the cost model
(``mapping.cost``) and the search (``mapping.search``) read them."""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rlhf.mapping.profile import DeviceProfile


@dataclass(frozen=True)
class Layout:
    """A role's parallel sizes on its devices: training (pp, dp, tp) and, for the generating actor, ``tp_g``."""

    pp: int
    dp: int
    tp: int
    tp_g: int = 0
    """Generation tensor-parallel degree (divides tp); 0 for roles that do not generate."""
    cp: int = 1
    """Context-parallel degree (divides dp): each rank holds a 1/cp chunk of every micro-batch's activations, for
    four all-to-alls per layer and pass (Ulysses, where cp splits the heads) or the keys and values passed around the
    ring (elsewhere)."""
    ep: int = 1
    """Expert-parallel degree (divides dp and the expert count): each MoE layer's experts split over ep DP ranks, FSDP
    gathering each share over dp / ep, tokens sent to their experts and back by two all-to-alls per layer and pass."""
    fsdp: int = 0
    """FSDP's shard group (``<role>.fsdp_size``; divides dp): 0 shards over all of dp; below dp, HSDP: FSDP's
    gathers and reduce-scatters over the group, the gradients all-reduced across the dp / fsdp replicas."""

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def fsdp_shards(self) -> int:
        return self.fsdp or self.dp

    @property
    def fsdp_replicas(self) -> int:
        return self.dp // self.fsdp_shards

    def __str__(self) -> str:
        text = f"pp={self.pp} dp={self.dp} tp={self.tp}"
        text += (f" ep={self.ep}" if self.ep > 1 else "") + (f" cp={self.cp}" if self.cp > 1 else "")
        text += f" fsdp_size={self.fsdp}" if self.fsdp_replicas > 1 else ""
        return text + (f" tp_g={self.tp_g}" if self.tp_g else "")


@dataclass(frozen=True)
class Cluster:
    """The devices being placed: how many, how they group into nodes, and what each can do."""

    devices: int
    gpus_per_node: int
    profile: DeviceProfile

    def spans_nodes(self, extent: int) -> bool:
        """Whether a group covering ``extent`` consecutive ranks (pools start on node boundaries) crosses nodes."""
        return extent > self.gpus_per_node

    def all_gather(self, gathered_bytes: float, size: int, *, extent: int) -> float:
        """Seconds for ``size`` ranks to gather ``gathered_bytes`` in all (each sends (size-1)/size of it)."""
        if size <= 1:
            return 0.0
        bandwidth = self.profile.link_bandwidth(across_nodes=self.spans_nodes(extent))
        # A ring: size - 1 steps, each paying the link latency and moving 1/size of the bytes.
        return (size - 1) * (gathered_bytes / size / bandwidth + self.profile.collective_latency)

    def all_to_all(self, sent_bytes: float, size: int, *, extent: int) -> float:
        """Seconds for each of ``size`` ranks to exchange ``sent_bytes`` of its own (keeping 1/size of them) with the
        others, pairwise: size - 1 exchanges, each paying the link latency."""
        if size <= 1:
            return 0.0
        bandwidth = self.profile.link_bandwidth(across_nodes=self.spans_nodes(extent))
        return sent_bytes * (size - 1) / size / bandwidth + (size - 1) * self.profile.collective_latency

    def all_reduce(self, num_bytes: float, size: int, *, extent: int) -> float:
        """Seconds to all-reduce ``num_bytes`` over ``size`` ranks (reduce-scatter + all-gather)."""
        if size <= 1:
            return 0.0
        return 2 * self.all_gather(num_bytes, size, extent=extent)
