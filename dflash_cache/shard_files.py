"""A shard's files as the reader opens them: Arrow tables memory-mapped (or fetched whole from an
object store) and an uncompressed Zarr array's chunk files read straight from local disk."""

from __future__ import annotations

import json
import mmap
import os
import sys
from functools import lru_cache

import numpy as np
import pyarrow as pa

from dflash_cache import format as fmt
from dflash_common.errors import CacheError


def rows_out(shape: tuple, dtype: np.dtype, start: int, stop: int, out: np.ndarray | None) -> np.ndarray:
    """Where rows start..stop of an array of ``shape`` and ``dtype`` are read into: ``out`` when
    given (checked: C-contiguous, those rows' shape, the same item size), else a new array."""
    rows = (max(0, stop - start), *shape[1:])
    if out is None:
        return np.empty(rows, dtype=dtype)
    if out.shape != rows or out.dtype.itemsize != dtype.itemsize or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous, of shape {rows} and {dtype.itemsize}-byte items, "
                         f"got {out.dtype} {out.shape}")
    return out


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
            with open(os.path.join(path, "zarr.json"), "rb") as f:
                meta = json.loads(f.read())
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
            data = mapped_file(path, info.st_ino, info.st_size, info.st_mtime_ns)
            first, last = lo * self.row_bytes, hi * self.row_bytes
            if len(data) < last:
                raise CacheError(f"{path}: chunk file is short ({max(0, len(data) - first)} of {last - first} bytes at "
                                 f"row {lo}); the shard is damaged (run `dflash-cache verify --deep`, then rebuild "
                                 "or skip the shard)")
            dest[(row - start) * self.row_bytes:(row - start + hi - lo) * self.row_bytes] = data[first:last]
            row += hi - lo
        return out


@lru_cache(maxsize=64)
def mapped_file(path: str, inode: int, size: int, mtime_ns: int) -> np.ndarray:
    """A read-only map of a whole chunk file as uint8, kept for the next reads of the same file
    (the identity arguments make a changed file a new entry)."""
    if size == 0:
        return np.empty(0, dtype=np.uint8)  # mmap refuses empty files
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def open_ipc(fs, path: str) -> pa.Table:
    if fmt.is_local(fs):
        return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
    return pa.ipc.open_file(pa.BufferReader(fs.cat_file(path))).read_all()


def list_width_problem(table: pa.Table, column: str, width: int, field: str) -> str | None:
    """Why ``column`` of a token table is not a fixed-size list of ``width`` values per token (the
    manifest's ``field``), or None."""
    kind = table.schema.field(column).type if column in table.column_names else None
    if kind is None:
        return f"{fmt.TOKENS} lacks the column {column!r}"
    if not pa.types.is_fixed_size_list(kind) or kind.list_size != width:
        return f"{fmt.TOKENS} column {column} is {kind}, not {width} values per token (the manifest's {field} = {width:,})"
    return None


def fixed_list_values(table: pa.Table, column: str, k: int, field: str, where: str) -> np.ndarray:
    problem = list_width_problem(table, column, k, field)
    if problem:
        raise CacheError(f"{where}: {problem}; the manifest or the shard is damaged or edited: run `dflash-cache verify`, "
                         "then rebuild the cache (or restore manifest.json)")
    return table.column(column).combine_chunks().values.to_numpy(zero_copy_only=True).reshape(-1, k)
