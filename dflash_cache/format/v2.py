"""Format 2, what a build writes: shards under one folder per rank, each hidden-state array one Zarr
shard object with a crc32c per inner chunk, and a columnar index (dflash_cache.format.index) the
manifest points at. ``LAYOUT`` is what the reader, the writer and verify ask of it (the interface
is dflash_cache.format.versions')."""

from __future__ import annotations

import os
import re
import uuid

import numpy as np
import pyarrow as pa

from dflash_cache.format import index
from dflash_cache.format.cache_layout import SEQUENCES, SHARDS_DIR, TOKENS, inside_cache, join, rank_folder, rank_of
from dflash_cache.format.hidden import ShardedHidden, write_hidden
from dflash_cache.format.store import CacheStore, reaching


class IndexListing:
    """A format-2 cache's shards, from its index: two reads whatever the shard count, no shard
    file opened until a shard is read."""

    def __init__(self, store: CacheStore, manifest: dict):
        self.store = store
        with reaching(store.url):
            self.table, self.sequences = index.open_index(store, manifest)
        counts = self.table.numpy("sequences") if len(self.table) else np.zeros(0, np.int64)
        self.first_sequence = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.names = self.table.column("name")
        if store.local:
            inside_cache(os.path.realpath(store.root), store.path(SHARDS_DIR), store.url)

    def record(self, j: int) -> dict:
        return self.table.record(j)

    def totals(self) -> dict:
        return self.table.totals()

    def checksums(self) -> list[tuple[str, dict]]:
        c = self.table.column
        return [(name, {"hidden": h, TOKENS: t, SEQUENCES: q}) for name, h, t, q in
                zip(c("name"), c("checksum_hidden"), c("checksum_tokens"), c("checksum_sequences"))]

    def health(self, n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """(rms, zero_fraction, nonfinite) [shards, n_layers] (NaN rows: not recorded), tokens and names."""
        rms, zeros, nonfinite = (self.table.matrix(k, n_layers) for k in ("rms", "zero_fraction", "nonfinite"))
        tokens = self.table.numpy("tokens") if len(self.table) else np.zeros(0)
        return rms, zeros, nonfinite, tokens, self.names

    def shard_sequences(self, j: int) -> pa.Table:
        """Shard j's sequences (id, offset, length, row): its rows of the index's sequence table."""
        lo, hi = int(self.first_sequence[j]), int(self.first_sequence[j + 1])
        return self.sequences.slice(lo, hi - lo)

    def sequence_table(self, keep: list[int]) -> pa.Table:
        """The sequence table (index.sequence_schema) of the shards at positions ``keep``."""
        if len(keep) == len(self.names):
            return self.sequences
        return self.sequences.filter(pa.array(np.isin(self.sequences.column("shard").to_numpy(), keep)))

    def size_problems(self, skip) -> dict[str, list[str]]:
        """Nothing: format 2's sizes live in the index, and listing shards/ would cost a request per
        thousand objects at every start; a missing or short file shows when it is read (one line,
        the shard named) or verified."""
        return {}


class Layout:
    """Format 2's answers to what the reader, the writer and verify ask of a version."""

    version = 2
    read_parts = (TOKENS, "hidden")
    """A read takes each sequence's id, offset and length from the index, checked when the cache is
    opened, so its shards' sequences.arrow and commit records (the copies a lost index is rebuilt
    from) are left to `verify`, and a rank reads two files a shard instead of four."""
    plan_parts = ()
    """A plan over the whole cache reads the index alone."""
    hidden_checked_as_read = True
    hidden_files = ("zarr.json", "c/0/0/0")
    """The files of a shard's hidden.zarr: its metadata and its one Zarr shard object."""
    """Each inner chunk's crc32c is checked as it is read: no whole-array hash before a read."""
    ignored_entries = (".tmp",)
    """A rank's work folder under shards/rRRRRR/ (emptied on resume), not a shard."""

    def shard_path(self, root: str, name: str) -> str:
        return join(root, SHARDS_DIR, rank_folder(rank_of(name)), name)

    def open_hidden(self, path: str) -> ShardedHidden | None:
        return ShardedHidden.open(path)

    def check_manifest(self, manifest: dict, url: str) -> None:
        """Nothing beyond the header: the index is checked when it is read."""

    def listing(self, store: CacheStore, manifest: dict) -> IndexListing:
        return IndexListing(store, manifest)

    def manifest_body(self, store: CacheStore, records: list[dict], extra: dict) -> dict:
        """What format 2 adds to the manifest: its ``index`` entry (written here for a cache put
        together by hand, as benchmarks and tests do)."""
        if "index" not in extra and records:
            return {**extra, "index": index.index_records(store, records)}
        return extra

    def shard_folders(self, store: CacheStore) -> list[str]:
        """The folders whose entries are shards: one per rank (a listing each: linear)."""
        shards_dir = store.path(SHARDS_DIR)
        if not store.fs.exists(shards_dir):
            return []
        return [p for p in store.fs.ls(shards_dir, detail=False) if re.fullmatch(r"r\d{5}", p.rstrip("/").rsplit("/", 1)[-1])]

    def work_folder(self, root: str, rank: int) -> str:
        """Where a rank writes shards before renaming them into place (local storage): one folder per
        rank, so a resume deletes its leftovers without listing the shards."""
        return join(root, SHARDS_DIR, rank_folder(rank), ".tmp")

    def work_dir(self, root: str, name: str, rank: int) -> str:
        return join(self.work_folder(root, rank), f"{name}-{uuid.uuid4().hex[:8]}")

    def write_hidden(self, store: CacheStore, path: str, hidden: np.ndarray, attributes: dict, storage,
                     n_layers: int) -> tuple[str, int]:
        if hidden.ndim != 3:
            hidden = hidden.reshape(0, n_layers, 0)
        return write_hidden(store.zarr_store(path, read_only=False), hidden, attributes, storage.chunk_bytes,
                            storage.compression)


LAYOUT = Layout()
