"""Resuming a rank's build into its prepared output folder, and completing the rank.

``open_output`` writes the first manifest, finds the shards committed before (their commit
records), deletes what a killed build left uncommitted and writes the teacher files once;
``complete_rank`` writes the complete manifest (one process) or marks the rank done and merges
once every rank is (several).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from dflash_build.commit import (
    RANKS_DIR,
    ManifestKeeper,
    committed_ids,
    committed_records,
    committed_v2,
    finalize_cache,
    rank_marker,
)
from dflash_build.output import is_manifest_leftover
from dflash_cache import format as fmt
from dflash_cache.format.store import CacheStore
from dflash_cache.writer import work_folder
from dflash_common.errors import CacheError, DiskFullError
from dflash_common.files import is_disk_full


@contextmanager
def writing(what: str, url: str):
    """A full disk or a failing store is an expected failure: one line, and the rerun resumes."""
    try:
        yield
    except OSError as err:
        if is_disk_full(err):
            raise DiskFullError(f"{what} of {url}", "the shards committed before are intact and a rerun keeps them",
                                "rerun the same command to resume") from err
        raise CacheError(f"writing {what} to {url} failed: {err}; fix the storage, then rerun the same command to resume") from err


def _remove_uncommitted(store: CacheStore, rank: int, committed: set[str], version: int = 1) -> int:
    """Delete this rank's shard folders without a commit record (a crash mid-write left them);
    other ranks' folders are theirs to clean. Format 2: the rank's work folder and the one shard
    after the committed ones (shards are written one at a time, in order), found without a listing."""
    root = store.root
    if version != 1:
        removed = 0
        work, next_shard = work_folder(root, rank), fmt.shard_path(root, fmt.shard_name(rank, len(committed)), 2)
        if store.exists(work):
            removed += len(store.ls(work))  # half-written shards (the folder itself is kept empty)
            store.rm(work, recursive=True)
        if store.exists(next_shard):  # in place, its commit record not yet written
            store.rm(next_shard, recursive=True)
            removed += 1
        return removed
    shards_dir = store.path(fmt.SHARDS_DIR)
    if not store.exists(shards_dir):
        return 0
    prefix = fmt.shard_name(rank, 0)[:-6]
    removed = 0
    for path in store.ls(shards_dir):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(".json") or name in committed:
            continue
        if name.startswith(prefix) or name.startswith(f".tmp-{prefix}"):
            store.rm(path, recursive=True)
            removed += 1
    return removed


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

    def seen(self, store: CacheStore) -> dict[str, int]:
        """The corpus row of every committed sequence id."""
        return committed_ids(store, self.records, self.sequences)

    @property
    def start_row(self) -> int:
        """The first corpus row no committed shard covers."""
        return self.records[-1]["rows"][1] if self.records else 0


def open_output(store: CacheStore, header: dict, rank: int, live: bool, write_head: Callable[[], dict]) -> Resume:
    """Resume into a prepared output folder: write the first manifest, delete what a killed build
    left uncommitted, write the teacher files once (rank 0, `write_head`), and unmark the rank."""
    url, root = store.url, store.root
    version = int(header.get("format_version", fmt.FORMAT_VERSION))
    records, sequences = committed_v2(store, rank) if version != 1 else (committed_records(store, rank), None)
    manifest_path = store.path(fmt.MANIFEST)
    previous = store.read_json_unchecked(manifest_path) if store.exists(manifest_path) else {}
    fmt.check_resumed_fields(previous, url)  # prepare_output checked it; another rank may have written it since
    marker = rank_marker(root, rank)
    # the head's record, kept from the manifest (one process) or this rank's marker (several)
    # when the head is not written again below
    head_record = previous.get("teacher_head") or (store.read_json_unchecked(marker).get("teacher_head")
                                                   if store.exists(marker) else None)
    with writing("the manifest", url):  # first: it marks the folder as a cache under construction
        keeper = ManifestKeeper(store, header, records, live=live, sequences=sequences, rank=rank)
    if live:  # other ranks may be writing a manifest of their own right now
        for path in store.ls(root):
            if is_manifest_leftover(path):
                store.rm(path)
    removed = _remove_uncommitted(store, rank, {r["name"] for r in records}, version)
    # rewritten when missing, and when its record is lost before this rank committed anything (a
    # build killed between writing the head and recording it): then a rewrite costs little
    if rank == 0 and (not store.exists(store.path(fmt.TEACHER_DIR, fmt.TEACHER_HEAD))
                      or (not records and not head_record)):
        with writing("the teacher files", url):
            head_record = write_head()
    if rank == 0 and head_record:
        keeper.header["teacher_head"] = head_record
        if keeper.live:  # recorded at once, not with the first commit
            with writing("the manifest", url):
                keeper.write(complete=False, fault=False)
    if store.exists(marker):  # this rank is at work again, not finished
        store.rm(marker)
    return Resume(records, keeper, previous.get("last_run"), head_record, removed, sequences)


def complete_rank(store: CacheStore, storage_options: dict | None, resume: Resume, rank: int,
                  last_run: dict) -> dict | None:
    """This rank is done: one process writes the complete manifest; with several ranks, this one
    marks itself done and whichever rank sees all markers merges the manifest (the last to
    finish always does, and a duplicate merge writes the same bytes; it opens the store afresh,
    with ``storage_options``). Returns the complete manifest, or None while other ranks are still
    at work."""
    url, root = store.url, store.root
    if resume.keeper.version != 1:
        if store.exists(work_folder(root, rank)):  # empty now: every shard was moved into place
            store.rm(work_folder(root, rank), recursive=True)
    if resume.keeper.live:
        with writing("the manifest", url):
            return resume.keeper.write(complete=True, last_run=last_run)
    if resume.keeper.version != 1:
        with writing("the index", url):  # the whole part, before the rank says it is done
            resume.keeper.checkpoint()
    store.makedirs(store.path(RANKS_DIR))
    head = {"teacher_head": resume.head_record} if rank == 0 and resume.head_record else {}
    store.write_json_atomic(rank_marker(root, rank), {"rank": rank, **last_run, **head})
    try:
        return finalize_cache(url, storage_options)
    except CacheError as err:
        if "have not finished" not in str(err):
            raise
        return None
