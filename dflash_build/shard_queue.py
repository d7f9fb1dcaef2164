"""The queue a cut shard goes through: the teacher, then the writer thread, then the commit.

Cut shards go to the teacher in generate groups (shard_cut.shards_per_generate: one vLLM generate
fills several engine steps), up to ``TeacherPass.in_flight`` groups at once: a group's outputs are
taken (and its shards go to the writer) once the next group is submitted, so an engine in another process never
waits while the build receives, checks and writes. Shards still go to the writer, and commit, in
order. The writer thread writes each finished shard whole (``writer.write_shard``) and hands its
commit to the manifest keeper.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from dflash_build.shard_cut import PendingShard
from dflash_build.teacher_pass import TeacherPass
from dflash_cache import format as fmt
from dflash_cache.format.store import CacheStore
from dflash_cache.settings.storage_config import StorageConfig
from dflash_cache.writer import ShardData, sequences_table, write_shard
from dflash_common.errors import CacheError, DiskFullError
from dflash_common.files import is_disk_full


@dataclass
class Committed:
    """A shard just committed: its commit record and its sequences.arrow table (for the index)."""

    record: dict
    sequences: pa.Table


def write_committed(store: CacheStore, storage: StorageConfig, hidden_dtype: str, version: int, layer_ids: list[int],
                    seconds: Counter | None, shard: ShardData) -> Committed:
    """Write and commit one finished shard (adding the seconds of its parts to ``seconds``); what
    the manifest keeper is told of it."""
    return Committed(write_shard(store, shard, storage, hidden_dtype, version, layer_ids, seconds),
                     sequences_table(shard))


class BackgroundWriter:
    """Writes shards on a thread so the teacher computes the next batch meanwhile.

    At most ``max_pending`` shards wait in memory; ``submit`` blocks beyond that. A failure on the
    writer thread is raised in the caller at the next ``submit`` or at ``close``.
    """

    def __init__(self, write: Callable[[ShardData], Committed], on_commit: Callable[[Committed], None],
                 max_pending: int = 1, out: str = "the cache", committed: int = 0):
        self._write, self._on_commit = write, on_commit
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        # for the error line: where the shards go, how many of this rank's are committed, the one that failed
        self._out, self._committed, self._failed = out, committed, ""
        self._thread = threading.Thread(target=self._run, name="dflash-shard-writer", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            shard = self._queue.get()
            if shard is None:
                return
            if self._error is not None:
                continue
            try:
                self._on_commit(self._write(shard))
                self._committed += 1
            except BaseException as err:  # re-raised in the producer thread
                self._error, self._failed = err, fmt.shard_name(shard.rank, shard.index)

    def _raise(self):
        err = self._error  # sticky: later shards are never written after a failed one
        if err is not None:
            kept = (f"the {self._committed} shard(s) of this rank committed before it are intact and a rerun keeps them"
                    if self._committed else "no shard of this rank was committed yet")
            if is_disk_full(err):
                raise DiskFullError(f"shard {self._failed} of {self._out}", kept, "rerun the same command to resume") from err
            if isinstance(err, OSError):
                raise CacheError(f"writing shard {self._failed} of {self._out} failed: {err} ({kept}); fix the storage, "
                                 "then rerun the same command to resume") from err
            raise err

    def submit(self, shard: ShardData) -> None:
        self._raise()
        self._queue.put(shard)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._raise()


class ShardQueue:
    """Cut shards to the teacher in generate groups of ``group`` shards (group g: shards
    [g * group, (g + 1) * group), ``teacher.in_flight`` groups at once), their data to the
    background writer, in order; ``on_commit`` is told of each committed shard, on the writer's
    thread."""

    def __init__(self, teacher: TeacherPass, write: Callable[[ShardData], Committed],
                 on_commit: Callable[[Committed], None], group: int = 1, out: str = "the cache", committed: int = 0):
        self._teacher, self._group_size = teacher, group
        self._group: list[PendingShard] = []  # the group being cut
        self._in_flight: deque[Callable[[], list[ShardData]]] = deque()
        self._background = BackgroundWriter(write, on_commit, out=out, committed=committed)

    def put(self, pending: PendingShard) -> None:
        """Add a cut shard to its group; a complete group goes to the teacher."""
        self._group.append(pending)
        if (pending.index + 1) % self._group_size == 0:
            self._submit_group()

    def _submit_group(self) -> None:
        """Submit the group being cut to the teacher; hand the oldest groups' shards to the writer
        while more than the teacher's share are in flight."""
        self._in_flight.append(self._teacher.start(self._group))
        self._group = []
        while len(self._in_flight) >= max(1, self._teacher.in_flight):
            self._write_oldest()

    def _write_oldest(self) -> None:
        for shard in self._in_flight.popleft()():
            self._background.submit(shard)

    def close(self, last: PendingShard | None) -> None:
        """Submit the ``last`` shard (if any) and the group it ends, and wait until every shard is
        committed; raises the first failure."""
        try:
            if last is not None:
                self._group.append(last)
            if self._group:
                self._submit_group()
            while self._in_flight:
                self._write_oldest()
        except BaseException:
            self.abort()
            raise
        self._background.close()

    def abort(self) -> None:
        """After a failure in the build: let the shards already written commit (they are valid
        work), without raising a failure of theirs over the one being handled. Shards still with
        the teacher are dropped (never committed: a rerun computes them again)."""
        self._in_flight.clear()
        self._group = []
        try:
            self._background.close()
        except Exception:
            pass
