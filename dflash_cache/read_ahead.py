"""Reading the sequences a caller will ask for next on background threads, within a byte budget
(``Cache.read_ahead``): the prefetch from object stores, and locally the overlap of reads with the
caller's work."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np

from dflash_cache.shard import SequenceRecord


class ReadAhead:
    """Iterator of records read ahead on a thread pool within a byte budget (``Cache.read_ahead``).
    ``peak_bytes`` is the most that was ever read ahead and not yet handed out."""

    def __init__(self, cache, refs: Iterable[tuple], max_bytes: int, threads: int, check: bool = False):
        if max_bytes < 0 or threads < 1:
            raise ValueError(f"read-ahead needs max_bytes >= 0 and threads >= 1, got {max_bytes} and {threads}")
        self.cache, self.refs, self.max_bytes, self.threads, self.check = cache, iter(refs), max_bytes, threads, check
        self.peak_bytes = 0
        self._run = self._records()

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> SequenceRecord:
        return next(self._run)

    def close(self) -> None:
        self._run.close()

    def _read(self, shard: int, i: int, out: np.ndarray | None = None) -> SequenceRecord:
        if self.check:
            self.cache.shards[shard].ensure_intact()
        return self.cache.shards[shard].read(i, out)

    def _records(self) -> Iterator[SequenceRecord]:
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="dflash-read-ahead")
        pending: deque = deque()
        held, upcoming, exhausted = 0, None, False
        try:
            while True:
                while not exhausted:
                    if upcoming is None:
                        upcoming = next(self.refs, None)
                        if upcoming is None:
                            exhausted = True
                            break
                    size = self.cache.sequence_bytes(*upcoming[:2])
                    if pending and held + size > self.max_bytes:
                        break
                    pending.append((pool.submit(self._read, *upcoming), size))
                    held += size
                    self.peak_bytes = max(self.peak_bytes, held)
                    upcoming = None
                if not pending:
                    return
                future, size = pending.popleft()
                held -= size
                yield future.result()
        finally:
            for future, _ in pending:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
