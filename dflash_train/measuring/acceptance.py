"""Accepted length the three ways serving engines and drafter cards report it, the per-request
distribution behind them, and the confidence observations of real decoding: pure functions of
per-request counts, the same for our decoder and for vLLM.

A request's counts are its draft steps n (verify forwards with drafts) and the drafts accepted
over them s; each step yields its accepted drafts plus the teacher's own token, so the request
produced n + s tokens in n steps, and its mean accepted length is 1 + s / n. Over requests:

- ``per_request_mean``: the mean over requests of each request's 1 + s / n (every request weighs
  the same; SPEED-Bench's per-category matrix, and the headline: requests are the independent
  units, so its interval over them is a real one, and one long answer cannot carry a category);
- ``pooled``: 1 + sum s / sum n, all accepted drafts over all draft steps (vLLM's spec-decode
  counters, the literature's tau: each request weighs by its steps; what tokens per teacher
  forward the whole workload got);
- ``token_weighted``: the mean of each request's 1 + s / n weighted by the tokens it produced,
  n + s (each request weighs by its output: the accepted length the average generated token saw
  its request get).

They differ by tens of percent on the same run when requests differ in length and acceptance.
A request with no draft step (its answer ended on the prefill's token) has no accepted length
and is left out of all three, counted in ``without_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_common.errors import ConfigError

DEFINITIONS = ("per_request_mean", "pooled", "token_weighted")
"""The three accepted lengths, in the order reports list them."""
HEADLINE = "per_request_mean"
"""The definition the per-category table's headline column (with its 95% interval) shows."""
LOW_FLOOR = 2.0
"""A request whose accepted length is below this gets less than one accepted draft per step:
speculation barely pays for its verify forwards there. Reports give the share of such requests."""
BIN_WIDTH = 0.5
"""Width of the per-request histogram's bins, from 1 (nothing accepted) up to P + 1 (every draft)."""


@dataclass(frozen=True)
class RequestCounts:
    """One request's draft steps and the drafts accepted over them."""

    steps: int
    accepted: int

    def __post_init__(self) -> None:
        if self.steps < 0 or self.accepted < 0:
            raise ConfigError(f"a request's draft steps ({self.steps}) and accepted drafts ({self.accepted}) must be >= 0")

    @property
    def mean(self) -> float:
        """1 + accepted / steps (needs steps > 0)."""
        return 1.0 + self.accepted / self.steps

    @property
    def tokens(self) -> int:
        """Tokens the steps produced: every accepted draft and one teacher token a step."""
        return self.steps + self.accepted


def counts_of(accepted_lengths: Sequence[int]) -> RequestCounts:
    """A request's counts from its tokens per verify forward (our decoder's accepted_lengths:
    accepted drafts + 1 each)."""
    return RequestCounts(len(accepted_lengths), sum(int(n) - 1 for n in accepted_lengths))


def definitions(requests: Sequence[RequestCounts]) -> dict[str, float | None]:
    """The three accepted lengths (DEFINITIONS) over requests; None each when none drafted."""
    drafted = [r for r in requests if r.steps > 0]
    if not drafted:
        return {name: None for name in DEFINITIONS}
    tokens = sum(r.tokens for r in drafted)
    return {"per_request_mean": sum(r.mean for r in drafted) / len(drafted),
            "pooled": 1.0 + sum(r.accepted for r in drafted) / sum(r.steps for r in drafted),
            "token_weighted": sum(r.tokens * r.mean for r in drafted) / tokens}


def histogram_edges(max_length: float, width: float = BIN_WIDTH) -> list[float]:
    """Bin edges from 1 to at least max_length in steps of width (the last bin closed)."""
    if not max_length >= 1 or not width > 0:
        raise ConfigError(f"a histogram of accepted lengths needs max_length >= 1 and width > 0, got {max_length}, {width}")
    bins = max(1, math.ceil((max_length - 1) / width - 1e-9))
    return [1.0 + i * width for i in range(bins + 1)]


def histogram(values: Sequence[float], edges: Sequence[float]) -> list[int]:
    """Counts of values per bin [edges[i], edges[i+1]), the last bin closed; a value outside the
    edges goes to the nearest end bin, so every request is counted."""
    counts = [0] * (len(edges) - 1)
    for value in values:
        index = next((i for i in range(len(counts)) if value < edges[i + 1]), len(counts) - 1)
        counts[index] += 1
    return counts


def acceptance_summary(requests: Sequence[RequestCounts], max_length: float, floor: float = LOW_FLOOR) -> dict:
    """What a report gives of some requests' acceptance: the three definitions, the headline's
    name, the histogram of per-request accepted length (bins up to max_length, P + 1), and the
    share of requests below floor."""
    means = [r.mean for r in requests if r.steps > 0]
    edges = histogram_edges(max_length)
    below = sum(m < floor for m in means)
    return {**definitions(requests), "headline": HEADLINE, "requests": len(means),
            "without_steps": len(requests) - len(means),
            "histogram": {"edges": edges, "counts": histogram(means, edges)},
            "below_floor": {"floor": floor, "requests": below, "share": below / len(means) if means else None}}


def step_observations(confidences: Sequence[float], accepted: int) -> list[tuple[int, float, float]]:
    """One verify forward's confidence observations (draft index, predicted, realised): each
    draft's estimate is of its acceptance given every draft before it was accepted, so the drafts
    up to the first rejection are observed (accepted: 1, the rejected one: 0) and those after it
    are not, their condition being false. ``confidences``: the head's estimate of each verified draft."""
    if not 0 <= accepted <= len(confidences):
        raise ConfigError(f"{accepted} accepted drafts of {len(confidences)} verified")
    observed = min(accepted + 1, len(confidences))
    return [(j, float(confidences[j]), 1.0 if j < accepted else 0.0) for j in range(observed)]
