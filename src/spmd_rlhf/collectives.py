"""The flat all-gather and reduce-scatter under the names this torch has: 2.13 renames ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` to ``all_gather_single`` and ``reduce_scatter_single`` (the old names kept, deprecated);
2.11 has only the old ones."""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_flat(output, input, group=...)``: every rank's ``input`` laid end to end in ``output``."""

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_flat(output, input, group=...)``: this rank's part of the sum of every rank's ``input``."""
