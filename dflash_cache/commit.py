"""A build's output folder: preparing it, resuming into it, and committing to its manifest.

A shard counts once its commit record ``shards/<name>.json`` exists (dflash_cache.writer writes
it last); the records are the source of truth on resume. manifest.json is written first (it
marks the folder as a cache under construction) and last (complete, from all records): by
``ManifestKeeper`` in a one-process build, by ``finalize_cache`` from every rank's records in a
multi-process one.
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from dflash_cache import format as fmt
from dflash_cache.cross_check import merge_records
from dflash_cache.format import index
from dflash_cache.format.store import CacheStore
from dflash_common.errors import CacheError
from dflash_common.resume_check import first_difference

# Manifest fields that must match for a rerun to resume into an existing cache.
RESUME_KEYS = ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype", "hidden_format", "corpus", "content_options")

RANKS_DIR = "ranks"

# A single-process build's live manifest is rewritten after every commit while it lists fewer
# shards than this (under ~1 MB of JSON); past it, see manifest_due.
LIVE_MANIFEST_SHARDS = 1000

# One writer per rank of a cache: each rank writes only its own shards (shard-rRRRRR-*), so two
# ranks of one torchrun build share the folder, and two builds of the same rank are refused.
_LOCK = re.compile(r"^\.dflash-r\d{5}\.lock$")

# Names a build writes under shards/: shard folders, their commit records and temporaries (format
# 1), and the rank folders holding them (format 2).
_RANK_FOLDER = re.compile(r"^r\d{5}$")
_SHARD_ENTRY = re.compile(r"^(\.?(tmp-)?shard-r\d{5}-\d{6}(\.json)?(-[0-9a-f]{8})?(\.tmp-[0-9a-f]+)?|r\d{5})$")

# A format-2 rank checkpoints its part of the index (and a one-process build its manifest) after
# every commit while it holds fewer shards than this, then once the commits since the last
# checkpoint reach 1/PART_GROWTH of its shards: each checkpoint rewrites the whole part, so this
# keeps the bytes rewritten per commit bounded (about PART_GROWTH shard rows), however long the build.
PART_EVERY_COMMIT = 64
PART_GROWTH = 16


def _resume_view(manifest: dict, key: str):
    value = manifest.get(key)
    if key == "teacher" and isinstance(value, dict):  # the hashes identify it; the path may move
        value = {k: v for k, v in value.items() if k not in ("name", "revision")}
    if key == "hidden_format":  # caches from before fp8 existed are lossless
        value = fmt.hidden_format_of(manifest)
    return value


def _mismatch(existing: dict, header: dict) -> str | None:
    return first_difference(existing, header, RESUME_KEYS, view=_resume_view, earlier_name="cache", now_name="this build")


def part_due(shards: int, since_checkpoint: int) -> bool:
    """Whether a format-2 rank rewrites its part of the index after a commit (see PART_GROWTH)."""
    return shards < PART_EVERY_COMMIT or since_checkpoint * PART_GROWTH >= shards


def committed_v2(fs, root: str, rank: int) -> tuple[list[dict], list]:
    """A format-2 rank's commit records, in order, and their rows of the sequence table (Arrow
    tables, shard positions local to the rank): its checkpointed part, then the commit records
    after it, found by name (no listing), with their shards' sequences.arrow."""
    import pyarrow as pa

    store = CacheStore(fs, root, root)
    records, part_sequences = index.read_part(store, rank)
    for expected, record in enumerate(records):
        if record["index"] != expected or record["rank"] != rank:
            raise CacheError(f"{root}: the index part of rank {rank} is out of order at shard {expected}; run "
                             "`dflash-cache verify` and rebuild with --overwrite")
    sequences = [part_sequences] if part_sequences.num_rows else []
    while True:
        name = fmt.shard_name(rank, len(records))
        path = fmt.shard_path(root, name, 2)
        if not fs.exists(f"{path}.json"):
            return records, sequences
        record = fmt.check_shard_paths(fmt.read_json(fs, f"{path}.json"), root,
                                       f"{fmt.SHARDS_DIR}/{fmt.rank_folder(rank)}/{name}.json")
        table = pa.ipc.open_file(pa.BufferReader(fs.cat_file(fmt.join(path, fmt.SEQUENCES)))).read_all()
        sequences.append(index.sequence_rows(table, len(records)))
        records.append(record)


def committed_records(fs, root: str, rank: int, version: int = 1) -> list[dict]:
    """Commit records of this rank's shards, in order; the source of truth on resume."""
    if version != 1:
        return committed_v2(fs, root, rank)[0]
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if not fs.exists(shards_dir):
        return []
    prefix = fmt.shard_name(rank, 0)[:-6]
    records = []
    for path in sorted(fs.glob(fmt.join(shards_dir, f"{prefix}*.json"))):
        # a record's name becomes a path (resume, finalize): the same check as the reader's
        records.append(fmt.check_shard_paths(fmt.read_json(fs, path), root, f"{fmt.SHARDS_DIR}/{path.rsplit('/', 1)[-1]}"))
    records.sort(key=lambda r: r["index"])
    # The writer commits in order, so committed shards are a prefix 0..n-1.
    for expected, record in enumerate(records):
        if record["index"] != expected:
            raise CacheError(f"shard records of rank {rank} have a gap at index {expected}; run `dflash-cache verify` and rebuild with --overwrite")
    return records


def committed_ids(fs, root: str, records: list[dict], sequences: list | None = None) -> dict[str, int]:
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
        path = fmt.join(root, fmt.SHARDS_DIR, record["name"], fmt.SEQUENCES)
        table = pa.ipc.open_file(pa.BufferReader(fs.cat_file(path))).read_all()
        for seq_id, row in zip(table.column("id").to_pylist(), table.column("row").to_pylist()):
            seen[seq_id] = row
    return seen


def _remove_uncommitted(fs, root: str, rank: int, committed: set[str], version: int = 1) -> int:
    """Delete this rank's shard folders without a commit record (a crash mid-write left them);
    other ranks' folders are theirs to clean. Format 2: the rank's work folder and the one shard
    after the committed ones (shards are written one at a time, in order), found without a listing."""
    if version != 1:
        from dflash_cache.writer import work_folder

        removed = 0
        work, next_shard = work_folder(root, rank), fmt.shard_path(root, fmt.shard_name(rank, len(committed)), 2)
        if fs.exists(work):
            removed += len(fs.ls(work, detail=False))  # half-written shards (the folder itself is kept empty)
            fs.rm(work, recursive=True)
        if fs.exists(next_shard):  # in place, its commit record not yet written
            fs.rm(next_shard, recursive=True)
            removed += 1
        return removed
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if not fs.exists(shards_dir):
        return 0
    prefix = fmt.shard_name(rank, 0)[:-6]
    removed = 0
    for path in fs.ls(shards_dir, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(".json") or name in committed:
            continue
        if name.startswith(prefix) or name.startswith(f".tmp-{prefix}"):
            fs.rm(path, recursive=True)
            removed += 1
    return removed


def _is_manifest_leftover(path: str) -> bool:
    """A temporary manifest left by a build killed before its first rename (local storage)."""
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(f"{fmt.MANIFEST}.tmp-")


def _is_index_leftover(fs, path: str) -> bool:
    """A format-2 build killed at its first manifest write: its index part was written first."""
    return path.rstrip("/").rsplit("/", 1)[-1] == fmt.INDEX_DIR and fs.isdir(path) \
        and _foreign_entry(fs, path, _BUILD_ENTRIES[fmt.INDEX_DIR]) is None


def _is_lock(path: str) -> bool:
    """A rank's lock file (lock_name): a build takes it before it writes its manifest."""
    return bool(_LOCK.match(path.rstrip("/").rsplit("/", 1)[-1]))


def lock_name(rank: int) -> str:
    return f".dflash-r{rank:05d}.lock"


@contextmanager
def writing(what: str, url: str):
    """A full disk or a failing store is an expected failure: one line, and the rerun resumes."""
    try:
        yield
    except OSError as err:
        raise CacheError(f"writing {what} to {url} failed: {err}; free space or fix the storage, then rerun the same command to resume") from err


# What a build writes in each of a cache's folders: is entry ``name`` (of ``kind``) one of ours?
_BUILD_ENTRIES = {
    fmt.SHARDS_DIR: lambda name, kind: bool(_SHARD_ENTRY.match(name)),
    fmt.INDEX_DIR: lambda name, kind: name in (fmt.SHARD_TABLE, fmt.SEQUENCE_TABLE) or bool(_RANK_FOLDER.match(name)),
    fmt.TEACHER_DIR: lambda name, kind: kind == "file",
    RANKS_DIR: lambda name, kind: kind == "file" and name.startswith("rank-"),
}


def _foreign_entry(fs, folder: str, ours, prefix: str = "") -> str | None:
    """The first entry under ``folder`` a build did not write (its path below the folder), or None.
    Format 2's rank folders under shards/ are looked into: they hold shards and the rank's .tmp."""
    for entry in fs.ls(folder, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if prefix and name == ".tmp" and entry.get("type") == "directory":
            continue  # the rank's work folder (writer.work_folder): half-written shards
        if not ours(name, entry.get("type")) or (prefix and _RANK_FOLDER.match(name)):
            return prefix + name
        if not prefix and _RANK_FOLDER.match(name) and entry.get("type") == "directory":
            inner = _foreign_entry(fs, entry["name"], ours, prefix=f"{name}/")
            if inner is not None:
                return inner
    return None


def _delete_cache(fs, root: str, url: str) -> None:
    """--overwrite on a dflash cache: delete what a build wrote (manifest, shards/, index/, teacher/,
    ranks/); anything else in those folders stops it before a file is deleted."""
    doomed = []
    for sub, ours in _BUILD_ENTRIES.items():
        folder = fmt.join(root, sub)
        if not fs.exists(folder):
            continue
        foreign = _foreign_entry(fs, folder, ours)
        if foreign is not None:
            raise CacheError(f"{url}: {sub}/{foreign} is not a file dflash writes; --overwrite deletes only what a "
                             "build made, so nothing was deleted: move it out of the cache and rerun")
        doomed.append(folder)
    for folder in doomed:
        fs.rm(folder, recursive=True)
    fs.rm(fmt.join(root, fmt.MANIFEST))


def existing_manifest(fs, root: str, url: str) -> dict | None:
    """The manifest of the cache at --out (None: a new or empty folder); refuses a file, a
    non-empty folder without one, and another tool's manifest. Read-only: checked before the
    build's lock file is made, so a folder that is not ours is never written into."""
    manifest_path = fmt.join(root, fmt.MANIFEST)
    if fs.isfile(root):
        raise CacheError(f"--out {url} is a file, not a folder; choose a new or empty folder for the cache")
    if not fs.exists(manifest_path) and fs.exists(root):
        others = [p for p in fs.ls(root, detail=False) if not _is_manifest_leftover(p) and not _is_lock(p)
                  and not _is_index_leftover(fs, p)]
        # checked again after the listing: another rank of this build writes the manifest first,
        # and may have done so since the first check (then the listing shows it, or its shards)
        if others and not fs.exists(manifest_path):
            raise CacheError(f"{url} is a non-empty folder without a dflash manifest; choose an empty or new --out")
    if not fs.exists(manifest_path):
        return None
    try:
        existing = fmt.read_json(fs, manifest_path)
    except ValueError:
        existing = None
    if not isinstance(existing, dict) or existing.get("format") != fmt.FORMAT_NAME:
        raise CacheError(f"{url} holds a manifest.json that is not a dflash cache's; choose another --out "
                         "(--overwrite deletes only dflash caches)")
    return existing


def prepare_output(fs, root: str, url: str, header: dict, overwrite: bool, new_version: int = fmt.FORMAT_VERSION) -> int:
    """Refuse a folder holding another build's cache (unless --overwrite deletes it), and make
    the folder (local storage) or check its bucket exists (object stores). Returns the format
    version this build writes, also set in ``header``: a format-1 cache is resumed as format 1
    (its shards stay as they are), anything new is ``new_version`` (--format-version)."""
    existing = existing_manifest(fs, root, url)
    version = new_version
    if existing is not None:
        readable = existing.get("format_version") in fmt.READ_VERSIONS
        problem = _mismatch(existing, header) if readable else "format version differs"
        if problem and not overwrite:
            raise CacheError(f"{url} holds a cache built with other settings: {problem}; rerun with the original settings to resume, or pass --overwrite to replace it")
        if overwrite:
            _delete_cache(fs, root, url)
        else:
            version = int(existing["format_version"])
    header["format_version"] = version
    if fmt.is_local(fs):
        # only the root: the manifest is the first thing a build writes, so a build killed before
        # it leaves at most a temporary manifest, which the rerun accepts (see _is_manifest_leftover)
        fs.makedirs(root, exist_ok=True)
    elif not fs.exists(root.split("/", 1)[0]):  # makedirs would silently create a mistyped bucket
        raise CacheError(f"{url}: the bucket {root.split('/', 1)[0]!r} does not exist; create it or fix --out")
    return version


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

    def __init__(self, fs, root: str, header: dict, records: list[dict], live: bool, sequences: list | None = None,
                 rank: int = 0):
        self.fs, self.root, self.header, self.live, self.rank = fs, root, header, live, rank
        self.version = int(header.get("format_version", fmt.FORMAT_VERSION))
        self.records = list(records)
        self.sequences = list(sequences or [])  # format 2: the records' rows of the sequence table
        self.checkpointed, self.entry = -1, None  # format 2: records in the part on storage, its index entry
        self.bytes = sum(int(r["bytes"]) for r in self.records)  # kept up to date: read per progress update
        self.lock = threading.Lock()
        self.last_written, self.last_write_s = time.perf_counter(), 0.0
        if live or not fs.exists(fmt.join(root, fmt.MANIFEST)):
            self.write(complete=False)

    def commit(self, committed) -> None:
        """Count a committed shard: a ``writer.Committed`` (or, format 1, its record)."""
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

        store = CacheStore(self.fs, self.root, self.root)
        sequences = pa.concat_tables(self.sequences) if self.sequences else index.sequence_schema().empty_table()
        self.entry = index.write_tables(store, index.part_paths(self.rank), index.shard_table(self.records), sequences,
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
                extra = {"index": merge_parts(CacheStore(self.fs, self.root, self.root), [(self.records, self.sequences)]),
                         **extra}
            elif self.live:  # several ranks: only finalize points the manifest at an index
                entry = self.entry if self.checkpointed == len(self.records) and self.entry else self.checkpoint()
                extra = {"index": entry, **extra}
        manifest = fmt.write_manifest(self.fs, self.root, self.header, self.records, complete,
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


@dataclass
class Resume:
    """Where a rank's build (re)starts in its prepared output folder."""

    records: list[dict]
    """This rank's shards committed before this run, in order."""
    keeper: ManifestKeeper
    """Writes the manifest; holds those records and the ones this run commits."""
    previous_run: dict | None
    """The manifest's `last_run`, kept when this run has nothing left to compute."""
    head_record: dict | None
    """The teacher head's record (rank 0), for the manifest or this rank's marker."""
    removed: int
    """Uncommitted shard folders a killed build left, now deleted."""
    sequences: list | None = None
    """Format 2: the committed shards' rows of the sequence table (Arrow tables)."""

    def seen(self, fs, root: str) -> dict[str, int]:
        """The corpus row of every committed sequence id."""
        return committed_ids(fs, root, self.records, self.sequences)

    @property
    def start_row(self) -> int:
        """The first corpus row no committed shard covers."""
        return self.records[-1]["rows"][1] if self.records else 0


def open_output(fs, root: str, url: str, header: dict, rank: int, live: bool,
                write_head: Callable[[], dict]) -> Resume:
    """Resume into a prepared output folder: write the first manifest, delete what a killed build
    left uncommitted, write the teacher files once (rank 0, `write_head`), and unmark the rank."""
    version = int(header.get("format_version", fmt.FORMAT_VERSION))
    records, sequences = committed_v2(fs, root, rank) if version != 1 else (committed_records(fs, root, rank), None)
    manifest_path = fmt.join(root, fmt.MANIFEST)
    previous = fmt.read_json(fs, manifest_path) if fs.exists(manifest_path) else {}
    marker = rank_marker(root, rank)
    # the head's record, kept from the manifest (one process) or this rank's marker (several)
    # when the head is not written again below
    head_record = previous.get("teacher_head") or (fmt.read_json(fs, marker).get("teacher_head")
                                                   if fs.exists(marker) else None)
    with writing("the manifest", url):  # first: it marks the folder as a cache under construction
        keeper = ManifestKeeper(fs, root, header, records, live=live, sequences=sequences, rank=rank)
    if live:  # other ranks may be writing a manifest of their own right now
        for path in fs.ls(root, detail=False):
            if _is_manifest_leftover(path):
                fs.rm(path)
    removed = _remove_uncommitted(fs, root, rank, {r["name"] for r in records}, version)
    # rewritten when missing, and when its record is lost before this rank committed anything (a
    # build killed between writing the head and recording it): then a rewrite costs little
    if rank == 0 and (not fs.exists(fmt.join(root, fmt.TEACHER_DIR, fmt.TEACHER_HEAD))
                      or (not records and not head_record)):
        with writing("the teacher files", url):
            head_record = write_head()
    if rank == 0 and head_record:
        keeper.header["teacher_head"] = head_record
        if keeper.live:  # recorded at once, not with the first commit
            with writing("the manifest", url):
                keeper.write(complete=False, fault=False)
    if fs.exists(marker):  # this rank is at work again, not finished
        fs.rm(marker)
    return Resume(records, keeper, previous.get("last_run"), head_record, removed, sequences)


def complete_rank(fs, root: str, url: str, storage_options: dict | None, resume: Resume, rank: int,
                  last_run: dict) -> dict | None:
    """This rank is done: one process writes the complete manifest; with several ranks, this one
    marks itself done and whichever rank sees all markers merges the manifest (the last to
    finish always does, and a duplicate merge writes the same bytes). Returns the complete
    manifest, or None while other ranks are still at work."""
    if resume.keeper.version != 1:
        from dflash_cache.writer import work_folder

        if fs.exists(work_folder(root, rank)):  # empty now: every shard was moved into place
            fs.rm(work_folder(root, rank), recursive=True)
    if resume.keeper.live:
        with writing("the manifest", url):
            return resume.keeper.write(complete=True, last_run=last_run)
    if resume.keeper.version != 1:
        with writing("the index", url):  # the whole part, before the rank says it is done
            resume.keeper.checkpoint()
    fs.makedirs(fmt.join(root, RANKS_DIR), exist_ok=True)
    head = {"teacher_head": resume.head_record} if rank == 0 and resume.head_record else {}
    fmt.write_json_atomic(fs, rank_marker(root, rank), {"rank": rank, **last_run, **head})
    try:
        return finalize_cache(url, storage_options)
    except CacheError as err:
        if "have not finished" not in str(err):
            raise
        return None


def finalize_cache(url: str, storage_options: dict | None = None) -> dict:
    """Merge every rank's commit records into a complete manifest once all ranks are done.

    The last rank of a multi-process build calls this itself; `dflash-cache finalize` calls it
    for ranks launched as independent jobs. Refuses while a rank is unfinished or when two ranks
    wrote the same sequence id.
    """
    fs, root = fmt.url_to_fs(url, storage_options)
    manifest = fmt.read_manifest(fs, root, url)
    world = int(manifest["content_options"]["world_size"])
    missing = [r for r in range(world) if not fs.exists(rank_marker(root, r))]
    if missing:
        raise CacheError(f"{url}: rank(s) {missing} of {world} have not finished; rerun their build (same command with RANK set) before finalizing")
    version = int(manifest["format_version"])
    if version != 1:
        parts = [committed_v2(fs, root, rank) for rank in range(world)]
        records = [r for part, _ in parts for r in part]
    else:
        records = [r for rank in range(world) for r in committed_records(fs, root, rank)]
        seen: dict[str, str] = {}
        for record in records:
            for seq_id in committed_ids(fs, root, [record]):
                if seq_id in seen:
                    raise CacheError(f"{url}: sequence id {seq_id!r} is in both {seen[seq_id]} and {record['name']}; make corpus ids unique and rebuild")
                seen[seq_id] = record["name"]
    runs = [fmt.read_json(fs, rank_marker(root, r)) for r in range(world)]
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
        entry = merge_parts(CacheStore(fs, root, url), parts)
        return fmt.write_manifest(fs, root, header, records, True, index=entry, last_run=last_run)
    keeper = ManifestKeeper(fs, root, header, records, live=False)
    return keeper.write(complete=True, last_run=last_run)
