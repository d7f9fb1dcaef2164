"""A build's commits: reading its commit records back, keeping manifest.json, and finalizing.

A shard counts once its commit record ``shards/<name>.json`` exists (``writer.write_shard`` writes
it last); the records are the source of truth on resume. manifest.json is written first (it marks
the folder as a cache under construction) and last (complete, from all records): by
``ManifestKeeper`` in a one-process build, by ``finalize_cache`` from every rank's records in a
multi-process one.
"""

from __future__ import annotations

import threading
import time

from dflash_build.cross_check import merge_records
from dflash_cache import format as fmt
from dflash_cache.format import index
from dflash_cache.format.store import CacheStore
from dflash_common.errors import CacheError

RANKS_DIR = "ranks"  # a rank's marker (rank_marker), once it has committed all its shards

# A single-process build's live manifest is rewritten after every commit while it lists fewer
# shards than this (under ~1 MB of JSON); past it, see manifest_due.
LIVE_MANIFEST_SHARDS = 1000

# A format-2 rank checkpoints its part of the index (and a one-process build its manifest) after
# every commit while it holds fewer shards than this, then once the commits since the last
# checkpoint reach 1/PART_GROWTH of its shards: each checkpoint rewrites the whole part, so this
# keeps the bytes rewritten per commit bounded (about PART_GROWTH shard rows), however long the build.
PART_EVERY_COMMIT = 64
PART_GROWTH = 16


def part_due(shards: int, since_checkpoint: int) -> bool:
    """Whether a format-2 rank rewrites its part of the index after a commit (see PART_GROWTH)."""
    return shards < PART_EVERY_COMMIT or since_checkpoint * PART_GROWTH >= shards


def committed_v2(store: CacheStore, rank: int) -> tuple[list[dict], list]:
    """A format-2 rank's commit records, in order, and their rows of the sequence table (Arrow
    tables, shard positions local to the rank): its checkpointed part, then the commit records
    after it, found by name (no listing), with their shards' sequences.arrow."""
    import pyarrow as pa

    records, part_sequences = index.read_part(store, rank)
    for expected, record in enumerate(records):
        if record["index"] != expected or record["rank"] != rank:
            raise CacheError(f"{store.url}: the index part of rank {rank} is out of order at shard {expected}; run "
                             "`dflash-cache verify` and rebuild with --overwrite")
    sequences = [part_sequences] if part_sequences.num_rows else []
    while True:
        name = fmt.shard_name(rank, len(records))
        path = fmt.shard_path(store.root, name, 2)
        if not store.exists(f"{path}.json"):
            return records, sequences
        record = fmt.check_shard_paths(store.read_json_unchecked(f"{path}.json"), store.root,
                                       f"{fmt.SHARDS_DIR}/{fmt.rank_folder(rank)}/{name}.json")
        table = pa.ipc.open_file(pa.BufferReader(store.read_bytes(fmt.join(path, fmt.SEQUENCES)))).read_all()
        sequences.append(index.sequence_rows(table, len(records)))
        records.append(record)


def committed_records(store: CacheStore, rank: int, version: int = 1) -> list[dict]:
    """Commit records of this rank's shards, in order; the source of truth on resume."""
    if version != 1:
        return committed_v2(store, rank)[0]
    shards_dir = store.path(fmt.SHARDS_DIR)
    if not store.exists(shards_dir):
        return []
    prefix = fmt.shard_name(rank, 0)[:-6]
    records = []
    for path in sorted(store.glob(fmt.join(shards_dir, f"{prefix}*.json"))):
        # a record's name becomes a path (resume, finalize): the same check as the reader's
        records.append(fmt.check_shard_paths(store.read_json_unchecked(path), store.root, f"{fmt.SHARDS_DIR}/{path.rsplit('/', 1)[-1]}"))
    records.sort(key=lambda r: r["index"])
    # The writer commits in order, so committed shards are a prefix 0..n-1.
    for expected, record in enumerate(records):
        if record["index"] != expected:
            raise CacheError(f"shard records of rank {rank} have a gap at index {expected}; run `dflash-cache verify` and rebuild with --overwrite")
    return records


def committed_ids(store: CacheStore, records: list[dict], sequences: list | None = None) -> dict[str, int]:
    """The corpus row of every sequence id in the shards of ``records`` (format 1: read from their
    sequences.arrow; format 2: from their rows of the sequence table, ``sequences``)."""
    import pyarrow as pa

    if sequences is not None:
        seen = {}
        for table in sequences:
            seen.update(zip(table.column("id").to_pylist(), table.column("row").to_pylist()))
        return seen
    seen: dict[str, int] = {}
    for record in records:
        path = store.path(fmt.SHARDS_DIR, record["name"], fmt.SEQUENCES)
        table = pa.ipc.open_file(pa.BufferReader(store.read_bytes(path))).read_all()
        for seq_id, row in zip(table.column("id").to_pylist(), table.column("row").to_pylist()):
            seen[seq_id] = row
    return seen


def manifest_due(shards: int, since_last_s: float, last_write_s: float) -> bool:
    """Whether a single-process build rewrites its live manifest after a commit: always while it
    is small, then only once the time since the last rewrite is 100x what that rewrite took, so
    rewrites stay under ~1% of the build. Rewriting per shard would be quadratic: a production
    build of ~100k shards has a ~100 MB manifest. Resume reads the commit records, not this."""
    return shards < LIVE_MANIFEST_SHARDS or since_last_s >= 100 * last_write_s


class ManifestKeeper:
    """Keeps manifest.json up to date: rewritten (atomically) after committed shards when one
    process builds (format 1: each one while the manifest is small, see manifest_due); with several
    ranks only the finalize step writes it, from all ranks' records.

    Format 2: the records and their sequences go into this rank's part of the index
    (``index/rRRRRR/``), checkpointed by ``part_due`` (a one-process build rewrites its small
    manifest with each checkpoint, pointing at the part); complete, a one-process build merges
    its part into the cache's index, as finalize does for several ranks."""

    def __init__(self, store: CacheStore, header: dict, records: list[dict], live: bool, sequences: list | None = None,
                 rank: int = 0):
        self.store, self.header, self.live, self.rank = store, header, live, rank
        self.version = int(header.get("format_version", fmt.FORMAT_VERSION))
        self.records = list(records)
        self.sequences = list(sequences or [])  # format 2: the records' rows of the sequence table
        self.checkpointed, self.entry = -1, None  # format 2: records in the part on storage, its index entry
        self.bytes = sum(int(r["bytes"]) for r in self.records)  # kept up to date: read per progress update
        self.lock = threading.Lock()
        self.last_written, self.last_write_s = time.perf_counter(), 0.0
        if live or not store.exists(store.path(fmt.MANIFEST)):
            self.write(complete=False)

    def commit(self, committed) -> None:
        """Count a committed shard: a ``shard_queue.Committed`` (or, format 1, its record)."""
        record = committed if isinstance(committed, dict) else committed.record
        with self.lock:
            self.records.append(record)
            self.bytes += int(record["bytes"])
            if self.version == 1:
                if self.live and manifest_due(len(self.records), time.perf_counter() - self.last_written, self.last_write_s):
                    self.write(complete=False)
                return
            self.sequences.append(index.sequence_rows(committed.sequences, int(record["index"])))
            if part_due(len(self.records), len(self.records) - self.checkpointed):
                if self.live:
                    self.write(complete=False)
                else:
                    self.checkpoint()

    def checkpoint(self) -> dict:
        """Write this rank's part of the index (format 2) with every record so far; returns the
        manifest's ``index`` entry for it."""
        import pyarrow as pa

        sequences = pa.concat_tables(self.sequences) if self.sequences else index.sequence_schema().empty_table()
        self.entry = index.write_tables(self.store, index.part_paths(self.rank), index.shard_table(self.records), sequences,
                                        complete=False)
        self.checkpointed = len(self.records)
        return self.entry

    def write(self, complete: bool, fault: bool = True, **extra) -> dict:
        """`fault`: whether this write counts as a `during_manifest_write` fault point (the crash
        tests count the writes that follow commits; the one recording the head is not one)."""
        started = time.perf_counter()
        if self.version != 1:
            if complete:
                self.checkpoint()
                extra = {"index": merge_parts(self.store, [(self.records, self.sequences)]), **extra}
            elif self.live:  # several ranks: only finalize points the manifest at an index
                entry = self.entry if self.checkpointed == len(self.records) and self.entry else self.checkpoint()
                extra = {"index": entry, **extra}
        manifest = fmt.write_manifest(self.store, self.header, self.records, complete,
                                      fault_point="during_manifest_write" if fault else None, **extra)
        self.last_written = time.perf_counter()
        self.last_write_s = self.last_written - started
        return manifest


def merge_parts(store: CacheStore, parts: list[tuple[list[dict], list]]) -> dict:
    """One (records, sequence tables) per rank -> the cache's index (``index/shards.arrow`` and
    ``index/sequences.arrow``, shard positions made global), refusing a sequence id two shards
    hold; returns the manifest's ``index`` entry (with sizes and checksums: it is final)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    records, tables, base = [], [], 0
    for part_records, part_sequences in parts:
        for table in part_sequences:
            shard = pc.add(table.column("shard"), pa.scalar(base, pa.int32()))
            tables.append(table.set_column(1, "shard", shard))
        records += part_records
        base += len(part_records)
    sequences = pa.concat_tables(tables) if tables else index.sequence_schema().empty_table()
    ids = sequences.column("id")
    if len(ids) and pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        dup = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        where = [records[int(i)]["name"] for i in sequences.filter(pc.equal(ids, dup)).column("shard").to_pylist()]
        raise CacheError(f"{store.url}: sequence id {dup!r} is in both {where[0]} and {where[1]}; make corpus ids unique "
                         "and rebuild")
    return index.write_tables(store, index.MERGED, index.shard_table(records), sequences, complete=True)


def rank_marker(root: str, rank: int) -> str:
    """The file a rank writes once it has committed all its shards."""
    return fmt.join(root, RANKS_DIR, f"rank-{rank:05d}.json")


def finalize_cache(url: str, storage_options: dict | None = None) -> dict:
    """Merge every rank's commit records into a complete manifest once all ranks are done.

    The last rank of a multi-process build calls this itself; `dflash-cache finalize` calls it
    for ranks launched as independent jobs. Refuses while a rank is unfinished or when two ranks
    wrote the same sequence id.
    """
    store = CacheStore.open(url, storage_options)
    manifest = fmt.read_manifest(store)
    fmt.check_resumed_fields(manifest, url)
    world = int((manifest.get("content_options") or {}).get("world_size", 1))
    missing = [r for r in range(world) if not store.exists(rank_marker(store.root, r))]
    if missing:
        raise CacheError(f"{url}: rank(s) {missing} of {world} have not finished; rerun their build (same command with RANK set) before finalizing")
    version = int(manifest["format_version"])
    if version != 1:
        parts = [committed_v2(store, rank) for rank in range(world)]
        records = [r for part, _ in parts for r in part]
    else:
        records = [r for rank in range(world) for r in committed_records(store, rank)]
        seen: dict[str, str] = {}
        for record in records:
            for seq_id in committed_ids(store, [record]):
                if seq_id in seen:
                    raise CacheError(f"{url}: sequence id {seq_id!r} is in both {seen[seq_id]} and {record['name']}; make corpus ids unique and rebuild")
                seen[seq_id] = record["name"]
    runs = [store.read_json_unchecked(rank_marker(store.root, r)) for r in range(world)]
    last_run = {"seconds": max(r["seconds"] for r in runs), "tokens": sum(r["tokens"] for r in runs),
                "padding_fraction": max(r["padding_fraction"] for r in runs)}
    checks = [r["cross_check"] for r in runs if r.get("cross_check")]
    if checks:
        last_run["cross_check"] = merge_records(checks)
    header = {k: v for k, v in manifest.items() if k not in ("shards", "totals", "complete", "last_run", "index")}
    # rank 0 wrote the teacher head and put its record in its marker (the first manifest may be
    # another rank's, written before the head existed)
    head = runs[0].get("teacher_head")
    if head:
        header["teacher_head"] = head
    if version != 1:  # one part per rank, merged: the shards' files are not read
        entry = merge_parts(store, parts)
        return fmt.write_manifest(store, header, records, True, index=entry, last_run=last_run)
    keeper = ManifestKeeper(store, header, records, live=False)
    return keeper.write(complete=True, last_run=last_run)
