"""Format 1, still read (and resumed by a build that started it): every shard in ``shards/<name>/``
with one file per Zarr chunk, and every commit record, chunk files included, listed in
manifest.json. ``LAYOUT`` is what the reader, the writer and verify ask of it (the interface is
dflash_cache.format.versions'); ``ChunkFiles`` reads its uncompressed hidden states straight
from the chunk files."""

from __future__ import annotations

import json
import os
import stat
import sys
import uuid

import numpy as np
import pyarrow as pa

from dflash_cache.format import index
from dflash_cache.format.cache_layout import SEQUENCES, SHARDS_DIR, check_shard_paths, checksum, inside_cache, join
from dflash_cache.format.hidden import read_zarr_json, rows_out
from dflash_cache.format.integrity import CHECKSUMMED, size_check
from dflash_cache.format.manifest import SHARD_RECORD_FIELDS, check_fields, record_shape_problem, totals
from dflash_cache.format.store import CacheStore, mapped_file
from dflash_common.errors import CacheError
from dflash_common.files import file_kind


class ChunkFiles:
    """Rows of an uncompressed Zarr v3 array on local disk, read straight from its chunk files.

    Zarr's read path costs ~4x a plain read of the same bytes (measured 0.65-0.94 GB/s against
    2.9-3.7 GB/s, benchmarks/RESULTS.md), and an uncompressed little-endian chunk file is just
    the chunk's rows in C order, so the rows can be copied into the caller's buffer directly. Only
    the layout the writer makes (chunked along the first axis, ``bytes`` codec alone) qualifies;
    ``open`` returns None for anything else and the caller uses Zarr.

    The files are memory-mapped rather than read with ``preadv``: measured 0.76-0.84x a raw
    memmap's copy with a warm page cache against 0.58-0.64x, and no slower cold, and the copies
    run in parallel on the read-ahead threads (benchmarks/RESULTS.md). Maps
    are keyed by the file's identity (inode, size, mtime), so a replaced, truncated or removed
    chunk file is seen at the next read; a size too small for the rows asked for is an error
    naming the file before anything is copied.
    """

    def __init__(self, path: str, shape: tuple[int, ...], chunk_rows: int, dtype: np.dtype, separator: str):
        self.path, self.shape, self.chunk_rows, self.dtype, self.separator = path, shape, chunk_rows, dtype, separator
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize

    @classmethod
    def open(cls, path: str) -> "ChunkFiles | None":
        try:
            meta = json.loads(read_zarr_json(path))
        except (OSError, ValueError):
            return None  # Zarr gives the precise error on the slow path
        codecs = meta.get("codecs", [])
        grid = meta.get("chunk_grid", {})
        keys = meta.get("chunk_key_encoding", {})
        shape, chunks = meta.get("shape"), grid.get("configuration", {}).get("chunk_shape")
        plain = (meta.get("zarr_format") == 3 and len(codecs) == 1 and codecs[0].get("name") == "bytes"
                 and codecs[0].get("configuration", {}).get("endian", "little") == "little"
                 and grid.get("name") == "regular" and keys.get("name") == "default"
                 and not meta.get("storage_transformers") and sys.byteorder == "little"
                 and isinstance(shape, list) and isinstance(chunks, list) and len(shape) == len(chunks) >= 1
                 and list(chunks[1:]) == list(shape[1:]) and meta.get("data_type") in ("uint8", "uint16", "float32"))
        if not plain:
            return None
        separator = keys.get("configuration", {}).get("separator", "/")
        return cls(path, tuple(shape), int(chunks[0]), np.dtype(meta["data_type"]), separator)

    def chunk_path(self, index: int) -> str:
        key = self.separator.join(["c", str(index)] + ["0"] * (len(self.shape) - 1))
        return os.path.join(self.path, *key.split("/"))

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop (clipped to the array, as a slice is), into ``out`` when given (a
        C-contiguous array of those rows' shape and this array's item size)."""
        start, stop = max(0, start), min(stop, self.shape[0])
        out = rows_out(self.shape, self.dtype, start, stop, out)
        dest = out.reshape(-1).view(np.uint8)
        row = start
        while row < stop:
            index, lo = divmod(row, self.chunk_rows)
            hi = min(self.chunk_rows, lo + stop - row)
            path = self.chunk_path(index)
            try:
                info = os.stat(path)
            except FileNotFoundError:
                raise CacheError(f"{path}: a chunk file of a committed shard is missing; the shard is damaged "
                                 "(run `dflash-cache verify --deep`, then rebuild or skip the shard)") from None
            if not stat.S_ISREG(info.st_mode):
                raise CacheError(f"{path}: a chunk file of a committed shard is a {file_kind(info.st_mode)}, not a regular "
                                 "file; the shard was edited (run `dflash-cache verify`, then rebuild or skip the shard)")
            data = mapped_file(path, info.st_ino, info.st_size, info.st_mtime_ns)
            first, last = lo * self.row_bytes, hi * self.row_bytes
            if len(data) < last:
                raise CacheError(f"{path}: chunk file is short ({max(0, len(data) - first)} of {last - first} bytes at "
                                 f"row {lo}); the shard is damaged (run `dflash-cache verify --deep`, then rebuild "
                                 "or skip the shard)")
            dest[(row - start) * self.row_bytes:(row - start + hi - lo) * self.row_bytes] = data[first:last]
            row += hi - lo
        return out


def write_hidden(store: CacheStore, path: str, hidden: np.ndarray, attributes: dict, chunk_bytes: int,
                 compression: str) -> tuple[str, int]:
    """Write the hidden states as one Zarr array, a file per chunk; returns their checksum and the chunk length."""
    from concurrent.futures import ThreadPoolExecutor

    import zarr
    import zarr.codecs

    n_tokens, n_layers, hidden_size = hidden.shape if hidden.ndim == 3 else (0, 0, 0)
    per_token = max(1, n_layers * hidden_size * hidden.dtype.itemsize)
    chunk_tokens = max(1, min(max(n_tokens, 1), chunk_bytes // per_token))
    compressors = [zarr.codecs.ZstdCodec(level=1)] if compression == "zstd" else None
    with ThreadPoolExecutor(1) as hashing:  # xxh64 releases the GIL: hash while Zarr writes
        digest = hashing.submit(checksum, hidden)
        zarr.create_array(store.zarr_store(path, read_only=False), data=hidden, chunks=(chunk_tokens, n_layers, hidden_size),
                          compressors=compressors, attributes=attributes, config={"write_empty_chunks": True},
                          overwrite=True)
    return digest.result(), chunk_tokens


class ManifestListing:
    """A format-1 cache's shards, from the commit records its manifest lists (each checked as
    untrusted when the cache is opened; on local storage, a shards folder, shard folder or commit
    record linked outside the cache is refused here, one lstat a shard)."""

    def __init__(self, store: CacheStore, manifest: dict):
        self.store, self.records = store, manifest["shards"]
        for record in self.records:  # names become paths below: none may leave the cache
            check_shard_paths(record, store.url)
        self.names = [record["name"] for record in self.records]
        if len(set(self.names)) != len(self.names):
            twice = next(name for name in self.names if self.names.count(name) > 1)
            raise CacheError(f"{store.url}: manifest.json lists the shard {twice} more than once; the manifest is not "
                             "trustworthy (edited or damaged): rebuild the cache with `dflash-cache build ... --overwrite`")
        counts = np.array([int(r["sequences"]) for r in self.records], dtype=np.int64)
        self.first_sequence = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if store.local:
            root, shards_dir = os.path.realpath(store.root), store.path(SHARDS_DIR)
            inside_cache(root, shards_dir, store.url)
            for name in self.names:
                for path in (join(shards_dir, name), join(shards_dir, f"{name}.json")):
                    if os.path.islink(path):
                        inside_cache(root, path, store.url)

    def record(self, j: int) -> dict:
        return self.records[j]

    def totals(self) -> dict:
        return totals(self.records)

    def checksums(self) -> list[tuple[str, dict]]:
        return [(r["name"], r["checksums"]) for r in self.records]

    def health(self, n_layers: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """(rms, zero_fraction, nonfinite) [shards, n_layers], tokens and names of the shards that record it."""
        rows = [(r.get("health") or {}, r["tokens"], r["name"]) for r in self.records]
        rows = [(h, t, n) for h, t, n in rows if len(h.get("rms", [])) == n_layers]
        rms, zeros, nonfinite = (np.array([h[k] for h, _, _ in rows]).reshape(-1, n_layers)
                                 for k in ("rms", "zero_fraction", "nonfinite"))
        return rms, zeros, nonfinite, np.array([t for _, t, _ in rows]), [n for _, _, n in rows]

    def shard_sequences(self, j: int) -> pa.Table:
        """Shard j's sequences (id, offset, length, row), from its own sequences.arrow."""
        return self.store.open_ipc(join(LAYOUT.shard_path(self.store.root, self.names[j]), SEQUENCES))

    def sequence_table(self, keep: list[int]) -> pa.Table:
        """The sequence table (index.sequence_schema) of the shards at positions ``keep``: each
        one's sequences.arrow read (the caller checks them first: ``Layout.plan_parts``)."""
        tables = [index.sequence_rows(self.shard_sequences(j), j) for j in keep]
        return pa.concat_tables(tables) if tables else index.sequence_schema().empty_table()

    def size_problems(self, skip: set[str] | frozenset[str]) -> dict[str, list[str]]:
        return size_check(self.store, {r["name"]: r["files"] for r in self.records}, skip)


class Layout:
    """Format 1's answers to what the reader, the writer and verify ask of a version."""

    version = 1
    read_parts = CHECKSUMMED
    """Format 1 reads each sequence's id, offset and length from its shard's sequences.arrow, so a
    read uses every checksummed part (checked with the commit record on disk)."""
    plan_parts = (SEQUENCES,)
    """What a plan over the whole cache reads: every shard's sequences.arrow."""
    hidden_checked_as_read = False
    hidden_files = ("zarr.json",)
    """The files of a shard's hidden.zarr a reader opens by name (its chunk files are checked as read)."""
    """Format 1 holds one xxh64 of a shard's whole array: hashed before any of it is read."""
    ignored_entries = ()

    def shard_path(self, root: str, name: str) -> str:
        return join(root, SHARDS_DIR, name)

    def open_hidden(self, path: str) -> ChunkFiles | None:
        return ChunkFiles.open(path)

    def check_manifest(self, manifest: dict, url: str) -> None:
        check_fields(manifest, url, ("shards",))
        for position, record in enumerate(manifest["shards"]):
            missing = [f for f in SHARD_RECORD_FIELDS if not isinstance(record, dict) or f not in record]
            if missing:
                raise CacheError(f"{url}: manifest.json shard entry {position} lacks {missing[0]!r}; the cache is "
                                 "damaged, rebuild it (or restore manifest.json)")
            problem = record_shape_problem(record, manifest)
            if problem:
                raise CacheError(f"{url}: manifest.json shard entry {position} {problem}; the manifest is damaged or "
                                 "edited: rebuild the cache (or restore manifest.json)")

    def listing(self, store: CacheStore, manifest: dict) -> ManifestListing:
        return ManifestListing(store, manifest)

    def manifest_body(self, store: CacheStore, records: list[dict], extra: dict) -> dict:
        """What format 1 adds to the manifest: every commit record."""
        return {"shards": records, **extra}

    def shard_folders(self, store: CacheStore) -> list[str]:
        """The folders whose entries are shards (verify names what else is there)."""
        return [store.path(SHARDS_DIR)]

    def work_dir(self, root: str, name: str, rank: int) -> str:
        """Where a shard is written before it is renamed into place (local storage)."""
        return join(root, SHARDS_DIR, f".tmp-{name}-{uuid.uuid4().hex[:8]}")

    def write_hidden(self, store: CacheStore, path: str, hidden: np.ndarray, attributes: dict, storage,
                     n_layers: int) -> tuple[str, int]:
        return write_hidden(store, path, hidden, attributes, storage.chunk_bytes, storage.compression)


LAYOUT = Layout()
