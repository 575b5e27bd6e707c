"""Which rows go into which micro-batch: row-count chunks, or token-balanced groups under a token budget (verl's
dynamic batch size, ``ppo_max_token_len_per_gpu``).

FSDP runs collectives in every forward (and backward), so every DP rank of a role must run the same number of
micro-batches. Under a token budget each rank's rows may need a different number, so the count is agreed over the DP
group (its maximum), and a rank that could do with fewer splits its rows into that many smaller groups: never an
empty micro-batch, since every DP rank holds as many rows as any other (``DPReducer.check_equal_shards``) and the
agreed count never exceeds that.

How the rows are grouped does not change a loss: each micro-batch's loss is its share of the mini-batch's loss,
with denominators counted over the whole mini-batch (``algos.aggregation``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices in ``parts`` non-empty groups of nearly equal token totals: longest-processing-time first (each row,
    longest first, joins the group with the fewest tokens so far; ties to the lower group). Each group lists its
    rows in ascending order; groups are ordered by their first row. Needs ``1 <= parts <= len(lengths)``."""
    if not 1 <= parts <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} rows into {parts} non-empty micro-batches")
    groups: list[list[int]] = [[] for _ in range(parts)]
    # With at least as many rows as groups, the first `parts` rows (longest first) each open an empty group.
    loads = [(0, group) for group in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda row: (-lengths[row], row)):
        load, group = heapq.heappop(loads)
        groups[group].append(row)
        heapq.heappush(loads, (load + lengths[row], group))
    return sorted((sorted(group) for group in groups), key=lambda group: group[0])


def fitting_parts(lengths: Sequence[int], max_tokens: int, at_least: int = 1) -> int:
    """The fewest groups, ``>= at_least``, for which ``balanced_partition`` keeps every group within ``max_tokens``.

    Terminates at ``len(lengths)`` groups at the latest (one row each), since every row fits on its own."""
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(f"a row of {longest} tokens exceeds the micro-batch budget of {max_tokens} tokens")
    parts = max(at_least, -(-sum(lengths) // max_tokens))
    while parts < len(lengths):
        if max(sum(lengths[row] for row in group) for group in balanced_partition(lengths, parts)) <= max_tokens:
            break
        parts += 1
    return parts


def token_balanced_micro_batches(
    lengths: Sequence[int], max_tokens: int, agree: Callable[[int], int], *, at_least: int = 1
) -> list[list[int]]:
    """Row indices of each micro-batch, every one within ``max_tokens`` tokens and as many as on every other rank,
    and at least ``at_least`` of them where there are that many rows (a 1F1B pipeline needs one per stage).

    ``agree(count)`` returns the maximum of ``count`` over the DP group (every rank calls it the same number of
    times). Each round, every rank proposes the fewest groups at least the agreed count that fit its rows; the
    rounds end when no rank needs more (usually the second round, which confirms the first)."""
    parts = max(1, min(at_least, len(lengths)))
    while True:
        agreed = agree(fitting_parts(lengths, max_tokens, at_least=parts))
        if agreed == parts:
            return balanced_partition(lengths, parts)
        parts = agreed


def row_chunks(rows: int, rows_per_micro_batch: int) -> list[list[int]]:
    """Consecutive rows, ``rows_per_micro_batch`` at a time (the last may be shorter): today's row-count
    micro-batches."""
    return [
        list(range(start, min(start + rows_per_micro_batch, rows))) for start in range(0, rows, rows_per_micro_batch)
    ]
