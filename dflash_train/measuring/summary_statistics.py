"""The statistics of a sweep's summary, pure functions of per-seed numbers: 95% t-intervals over
seeds (``t_interval``), differences from the reference configuration paired by seed
(``paired_difference``: seed i of both used the same drafter init, anchors and noise), curves
read at a budget (``interpolate``) or a target (``tokens_to_reach``), and rank agreement
(``spearman``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from dflash_common.errors import ConfigError

# t_{0.975, df} for df = 1..30 (two-sided 95%); beyond, the Cornish-Fisher expansion below.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959964


def t_quantile(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ConfigError(f"a t-interval needs at least 2 values (df >= 1), got df {df}; run --seeds 2 or more")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its 95% t-interval (low = high = mean when n < 2: no spread known)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def text(self, digits: int = 3) -> str:
        if self.n < 2:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def t_interval(values: Sequence[float]) -> Interval:
    """mean ± t_{0.975,n-1} · s/√n of the values (s the sample standard deviation)."""
    values = [float(v) for v in values]
    if not values:
        raise ConfigError("a t-interval of no values; every configuration needs at least one finished seed")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, mean, mean, n)
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * s / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float]) -> Interval | None:
    """The t-interval of value[seed] - reference[seed] over the seeds both have (None if none)."""
    seeds = sorted(set(values) & set(reference))
    if not seeds:
        return None
    return t_interval([values[s] - reference[s] for s in seeds])


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y at x through (x, y) points sorted by x; clamped at both ends."""
    if not points:
        raise ConfigError("no points to interpolate")
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def tokens_to_reach(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first x at which the piecewise-linear curve through (tokens, tau) points reaches
    ``target``, None when it never does."""
    if not points:
        return None
    if points[0][1] >= target:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return None


def tokens_by_step(batch_tokens: Sequence[int], grad_accum: int, steps: int) -> list[int]:
    """Training tokens seen after each step 1..steps, from the tokens of consecutive batches
    (``grad_accum`` batches a step; the batches repeat when the list is shorter)."""
    if not batch_tokens:
        raise ConfigError("the run's epoch plan has no batches")
    out, total, i = [], 0, 0
    for _ in range(steps):
        for _ in range(grad_accum):
            total += int(batch_tokens[i % len(batch_tokens)])
            i += 1
        out.append(total)
    return out


def ranks(values: Mapping[str, float]) -> dict[str, int]:
    """1 = the highest value; ties share the better rank."""
    ordered = sorted(values.values(), reverse=True)
    return {k: ordered.index(v) + 1 for k, v in values.items()}


def spearman(a: Mapping[str, float], b: Mapping[str, float]) -> float | None:
    """Spearman's rank correlation of two scores of the same keys (None for fewer than 3 keys
    or a constant score)."""
    keys = sorted(set(a) & set(b))
    if len(keys) < 3:
        return None
    ra, rb = _average_ranks([a[k] for k in keys]), _average_ranks([b[k] for k in keys])
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return None if va == 0 or vb == 0 else cov / math.sqrt(va * vb)


def _average_ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out
