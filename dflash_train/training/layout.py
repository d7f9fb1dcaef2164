"""Batch layouts (docs/design.md, "Batch layouts"): where each token of a batch's sequences lies.

``padded``: one sequence per row, right-padded to the longest ([N, T_max]). ``packed``: the
sequences laid end to end in one row ([1, sum T]), no padding. Either way a per-token tensor,
flattened over its first two dimensions, holds sequence i's position t at ``starts[i] + t``:
the loss targets and the drafter's block tokens are read through that one index, so the two
layouts share every code path but these few functions and the drafter's packed context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dflash_train.settings.data_config import PACKED, PADDED


def sequence_starts(lengths: Tensor, layout: str, width: int) -> Tensor:
    """Flat index [N] of each sequence's position 0 in a batch whose rows are `width` long: row
    i * width (padded) or the lengths' exclusive cumulative sum (packed)."""
    if layout == PADDED:
        return torch.arange(len(lengths), device=lengths.device) * width
    return torch.cumsum(lengths, 0) - lengths


def copy_to(host: Tensor, device: torch.device) -> Tensor:
    """A small tensor made on the host, copied to `device` without waiting for it (a blocking copy
    would make the host wait for every kernel queued before it)."""
    return host.to(device, non_blocking=True)


def slots(lengths: Sequence[int], layout: str) -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """The (rows, width) of a batch of these sequence lengths and, per sequence, the (row, first
    column) it starts at: what the loader fills, in numpy, before any tensor exists."""
    if layout == PADDED:
        return (len(lengths), max(lengths, default=0)), [(row, 0) for row in range(len(lengths))]
    starts = [0]
    for t in lengths[:-1]:
        starts.append(starts[-1] + int(t))
    return (1, sum(int(t) for t in lengths)), [(0, s) for s in starts]


def token_positions(lengths: Tensor) -> Tensor:
    """Each packed token's position in its own sequence, [sum T]: 0..T_i-1 per sequence, so
    rotary positions restart at every sequence exactly as in its padded row."""
    total = int(lengths.sum())
    starts = sequence_starts(lengths, PACKED, total)
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths, output_size=total)


def padding_fraction(batches: Sequence[Sequence[int]]) -> float:
    """Padded positions / all positions of right-padded batches of these sequence lengths (0 when
    packed: a packed batch has none)."""
    padded = sum(len(b) * max(b) for b in batches if len(b))
    real = sum(sum(b) for b in batches)
    return 1.0 - real / padded if padded else 0.0
