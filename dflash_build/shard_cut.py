"""The shard cut: one rank's sequences, in corpus order, into shards of a token budget.

A shard ends with the sequence that brings its tokens to ``shard_tokens`` (the input's tokens: the
cut never depends on the teacher), so a build resumed after its committed shards cuts the rest
exactly as an uninterrupted build would.

Shards go to the teacher in generate groups (``shards_per_generate``): group g is shards
[g * n, (g + 1) * n) of the rank, a rule of token counts alone. A build resumed inside a group cuts
again from the group's first row (``group_start``): the group's committed shards are sent once more
as context (``PendingShard.context``), so the engine sees the same generate, and are not rewritten.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dflash_cache import format as fmt


def shards_per_generate(generate_tokens: int | None, tokens_per_shard: int) -> int:
    """Shards sent to the engine in one generate: as many whole shards as ``generate_tokens`` holds,
    at least one (None: one shard per generate, the transformers engine's way)."""
    return 1 if generate_tokens is None else max(1, generate_tokens // tokens_per_shard)


def group_start(records: list[dict], group: int, total_rows: int) -> tuple[int, int]:
    """Where a resumed rank cuts again, given its committed ``records`` (in order), ``group``
    shards per generate and the corpus's ``total_rows``: the first shard of the group the next
    uncommitted shard belongs to, and that shard's first corpus row (the end of the committed rows
    at a group boundary, or once they reach the corpus's end: nothing is left to compute)."""
    first = len(records) // group * group
    if first == len(records) or records[-1]["rows"][1] >= total_rows:
        return len(records), records[-1]["rows"][1] if records else 0
    return first, records[first]["rows"][0]


def shard_tokens(shard_bytes: int, hidden_bytes_per_token: int) -> int:
    """How many tokens a shard holds: its hidden states reach ``shard_bytes`` (at least one token)."""
    return max(1, shard_bytes // hidden_bytes_per_token)


@dataclass
class PendingShard:
    """One shard's sequences, cut and named, before the teacher has run on them."""

    rank: int
    index: int
    row_start: int
    row_end: int
    sequences: list  # TokenizedSequence, in corpus order
    rows: list[int]  # corpus row index of each sequence
    skipped: dict[str, int]  # corpus rows of this shard's span that became no sequence, by reason
    context: bool = False  # committed before a resume: sent again for its group's generate, not written

    @property
    def name(self) -> str:
        return fmt.shard_name(self.rank, self.index)


class ShardCut:
    """Gathers one rank's sequences and cuts them into PendingShards. Shard ``index`` counts on
    from ``first_index`` and its row span from ``start_row``; a shard's span also covers the rows
    it skipped. Shards below index ``committed`` are context (committed before a resume)."""

    def __init__(self, rank: int, first_index: int, start_row: int, tokens_per_shard: int, committed: int = 0):
        self._rank, self._index, self._row_start = rank, first_index, start_row
        self._tokens_per_shard, self._committed = tokens_per_shard, committed
        self._start_shard()

    def _start_shard(self) -> None:
        self._sequences: list = []
        self._rows: list[int] = []
        self._tokens = 0
        self._skipped: Counter = Counter()

    def add(self, row: int, sequence) -> PendingShard | None:
        """Add corpus row ``row``'s sequence; returns the shard it fills, cut, or None."""
        self._sequences.append(sequence)
        self._rows.append(row)
        self._tokens += len(sequence.input_ids)
        return self._cut(row + 1) if self._tokens >= self._tokens_per_shard else None

    def skip(self, reason: str) -> None:
        """Count a row of this rank that became no sequence, in the shard being filled."""
        self._skipped[reason] += 1

    def last(self, end_row: int) -> PendingShard | None:
        """The last shard (ending before corpus row ``end_row``), or None when nothing is left."""
        return self._cut(end_row) if self._sequences or self._skipped else None

    def _cut(self, row_end: int) -> PendingShard:
        pending = PendingShard(self._rank, self._index, self._row_start, row_end, self._sequences, self._rows,
                               dict(self._skipped), context=self._index < self._committed)
        self._index, self._row_start = self._index + 1, row_end
        self._start_shard()
        return pending
