"""Which ranks work together when the actor switches from its training layout to its generation layout.

Training: the actor's ranks form a ``(pp, dp, tp = t)`` grid (tp fastest). Generation: tensor parallelism of
``tp_g`` dividing ``t``, every rank holding the whole model (all pipeline stages). View each TP group of size ``t``
as ``(tp_g, m = t / tp_g)``: training TP rank ``r = j * m + i`` holds generation shard ``j`` (the union of training
shards ``j*m .. j*m + m - 1``, contiguous along the split dimension). So

* the *micro-DP group* of a rank (same pp, dp, j; all i) all-gathers its ``m`` training shards into generation
  shard ``j``: the only weight traffic besides FSDP's all-gather, and no rank receives a byte it does not keep;
* the *generation TP group* (same pp, dp, i; all j) runs one engine replica, ``tp_g`` ranks with shards 0..tp_g-1;
* a training DP group (``pp * t`` ranks, all seeing the same prompts) holds ``pp * m`` generation replicas, each
  answering a contiguous share of the prompts; the *row group* (same dp, j; all pp, i) gathers their rows back so
  every rank of the DP group holds the whole rollout, as the training layout expects.

Plain Python over rank numbers, so it is unit-testable and every rank computes the same groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rlhf.parallel_dims import ParallelDims


@dataclass(frozen=True)
class GenerationLayout:
    dims: ParallelDims
    """The actor's training layout."""
    ranks: tuple[int, ...]
    """The actor's global ranks in pool order."""
    tp: int
    """Generation tensor-parallel degree ``tp_g``."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dims.tp % self.tp:
            raise ValueError(
                f"rollout.tp={self.tp} must divide actor.tp={self.dims.tp}: each generation shard is the union of "
                f"actor.tp / rollout.tp training shards"
            )

    @property
    def micro_dp(self) -> int:
        """``m = t / tp_g``: training TP ranks whose shards make up one generation shard."""
        return self.dims.tp // self.tp

    @property
    def replicas_per_dp_group(self) -> int:
        return self.dims.pp * self.micro_dp

    @property
    def num_replicas(self) -> int:
        """``dp_g``: generation replicas over all of the actor's ranks."""
        return self.dims.dp * self.replicas_per_dp_group

    def _rank(self, pp: int, dp: int, tp: int) -> int:
        return self.ranks[(pp * self.dims.dp + dp) * self.dims.tp + tp]

    def _where(self, rank: int) -> tuple[int, int, int, int]:
        """(pp, dp, j, i) of a global rank: its stage, DP replica, generation shard and place in its micro-DP group."""
        where = self.dims.coordinates(self.ranks.index(rank))
        return where.pp, where.dp, where.tp // self.micro_dp, where.tp % self.micro_dp

    def shard_index(self, rank: int) -> int:
        """``j``: the generation shard ``rank`` holds."""
        return self._where(rank)[2]

    def replica_index(self, rank: int) -> int:
        """Which of its DP group's ``pp * m`` generation replicas ``rank`` belongs to."""
        pp, _, _, i = self._where(rank)
        return pp * self.micro_dp + i

    def generation_tp_group(self, rank: int) -> list[int]:
        pp, dp, _, i = self._where(rank)
        return [self._rank(pp, dp, j * self.micro_dp + i) for j in range(self.tp)]

    def micro_dp_group(self, rank: int) -> list[int]:
        pp, dp, j, _ = self._where(rank)
        return [self._rank(pp, dp, j * self.micro_dp + i) for i in range(self.micro_dp)]

    def process_groups(self) -> dict[str, list[list[int]]]:
        """Every rank's groups of each kind, for the runtime to create (collectively) when the actor is spawned."""
        kinds = {
            "generation_tp": self.generation_tp_group,
            "micro_dp": self.micro_dp_group,
            "rollout_rows": self.row_group,
        }
        return {name: sorted({tuple(group(rank)) for rank in self.ranks}) for name, group in kinds.items()}

    def row_group(self, rank: int) -> list[int]:
        """Ranks holding generation shard ``j`` in ``rank``'s DP group, one per replica, in replica order."""
        _, dp, j, _ = self._where(rank)
        return [self._rank(pp, dp, j * self.micro_dp + i) for pp in range(self.dims.pp) for i in range(self.micro_dp)]
