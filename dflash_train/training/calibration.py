"""How well DSpark's confidence head knows what the teacher accepts: its calibration, from sums.

The head predicts, per draft position, the acceptance of that position given that every position
before it was accepted (the decoder multiplies the estimates along a block). Calibration compares
those predictions with the acceptance realised: the training target on the held-out split
(alpha or the greedy hit, teacher-forced), or in real decoding whether each verified draft was
accepted. Everything is computed from sums (per position, and per bin of the predicted value),
because sums are what the trainer's meters add over batches and all-reduce over ranks, and what
real decoding adds over rounds; ``bin_sums`` makes them, ``calibration_summary`` reads them.

- Per position j: the mean predicted and mean realised acceptance, and their absolute difference.
  ``mean_abs_error`` is that difference weighted by each position's observations, so the rarely
  reached last positions of a block (a handful of rounds) do not outweigh the first.
- ``ece``, the expected calibration error: observations binned by their predicted value into
  BINS equal bins of [0, 1]; the observation-weighted mean of |mean predicted - mean realised|
  over the bins. A head that says 0.9 where half is accepted scores 0.4 there.
- ``reliability``: the bins' counts and means, what a reliability diagram plots.
- ``calibrated``: ECE at most ECE_TOLERANCE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BINS = 10
"""Equal bins of the predicted acceptance over [0, 1] (the last one closed)."""

ECE_TOLERANCE = 0.1
"""The largest expected calibration error still called calibrated. vLLM 0.32's adaptive
verification sizes each verify from these estimates, so an error of 0.1 is a tenth of a block's
verified positions chosen from a wrong estimate; released DSpark cards state ~0.04."""

BIN_PARTS = ("count", "predicted", "measured")
BIN_SUMS = tuple(f"calibration_bin{b}_{part}" for b in range(BINS) for part in BIN_PARTS)
"""The names of the [P] sums per bin: observations, their predicted and their realised acceptance
summed by position (what meters keep beside the per-position "predicted" and "measured")."""


def bin_of(predicted: torch.Tensor) -> torch.Tensor:
    """The bin [...] long of predicted acceptances [...] in [0, 1] (1.0 falls in the last bin)."""
    return (predicted.float() * BINS).long().clamp(0, BINS - 1)


def bin_sums(predicted: torch.Tensor, measured: torch.Tensor, columns: torch.Tensor,
             num_positions: int) -> dict[str, torch.Tensor]:
    """BIN_SUMS of observations (predicted [T], measured [T] acceptance at block columns [T]):
    each a [P] float32 sum by column of the observations in that bin."""
    bins = bin_of(predicted)
    out = {}
    for b in range(BINS):
        chosen = (bins == b).float()
        for part, values in zip(BIN_PARTS, (chosen, predicted.float() * chosen, measured.float() * chosen)):
            total = torch.zeros(num_positions, dtype=torch.float32, device=predicted.device)
            out[f"calibration_bin{b}_{part}"] = total.index_add(0, columns, values.detach().float())
    return out


def _mean(total: float, count: float) -> float | None:
    return total / count if count > 0 else None


def calibration_summary(count: Sequence[float], predicted: Sequence[float], measured: Sequence[float],
                        bins: dict[str, Sequence[float]]) -> dict:
    """The calibration of sums by position (observations, predicted and realised acceptance
    summed, each [P]) and by bin (BIN_SUMS, each [P]); see the module docstring. A position or a
    bin without observations has None for its means."""
    count, predicted, measured = (list(map(float, x)) for x in (count, predicted, measured))
    total = sum(count)
    errors = [abs(p - m) / c if c > 0 else None for c, p, m in zip(count, predicted, measured)]
    weighted = sum(abs(p - m) for p, m in zip(predicted, measured))  # = sum_j count_j * |mean_p - mean_m|
    per_bin = {part: [sum(map(float, bins[f"calibration_bin{b}_{part}"])) for b in range(BINS)] for part in BIN_PARTS}
    ece = sum(abs(p - m) for p, m in zip(per_bin["predicted"], per_bin["measured"]))
    out = {
        "count": [int(round(c)) for c in count],
        "predicted": [_round(_mean(p, c)) for p, c in zip(predicted, count)],
        "measured": [_round(_mean(m, c)) for m, c in zip(measured, count)],
        "abs_error": [_round(e) for e in errors],
        "mean_abs_error": _round(_mean(weighted, total)),
        "ece": _round(_mean(ece, total)),
        "observations": int(round(total)),
        "reliability": {"edges": [b / BINS for b in range(BINS + 1)], "count": [int(round(c)) for c in per_bin["count"]],
                        "predicted": [_round(_mean(p, c)) for p, c in zip(per_bin["predicted"], per_bin["count"])],
                        "measured": [_round(_mean(m, c)) for m, c in zip(per_bin["measured"], per_bin["count"])]},
        "ece_tolerance": ECE_TOLERANCE,
    }
    out["calibrated"] = None if out["ece"] is None else out["ece"] <= ECE_TOLERANCE
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def observation_summary(positions: Sequence[int], predicted: Sequence[float], measured: Sequence[float],
                        num_positions: int) -> dict:
    """calibration_summary of single observations: draft position index (0-based column),
    predicted and realised acceptance of each."""
    columns = torch.tensor(list(positions), dtype=torch.long)
    p = torch.tensor(list(predicted), dtype=torch.float64)
    m = torch.tensor(list(measured), dtype=torch.float64)
    zeros = torch.zeros(num_positions, dtype=torch.float64)
    sums = bin_sums(p, m, columns, num_positions)
    return calibration_summary(zeros.index_add(0, columns, torch.ones_like(p)).tolist(),
                               zeros.index_add(0, columns, p).tolist(), zeros.index_add(0, columns, m).tolist(),
                               {name: value.tolist() for name, value in sums.items()})
