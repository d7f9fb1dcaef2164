"""The hidden states of a shard, encoded and decoded side by side: their stored dtype (bf16 as its
16-bit pattern, float32, or fp8 codes with per-token scales), and the array of a format-2 shard.

One Zarr v3 array per shard whose single Zarr *shard* object (``hidden.zarr/c/0/0/0``) holds every
inner chunk (zarr 3's ``sharding_indexed`` codec), so a shard has the same few files whatever the
chunk size. Each inner chunk is ``bytes`` (little endian) [+ ``zstd``] + ``crc32c`` (4 bytes
appended), and the shard index (offset and length of each inner chunk, uint64, at the end of the
object) carries its own crc32c: a reader checks exactly the bytes it reads, as it reads them.

``ShardedHidden`` is the fast local path (the format-2 twin of format 1's ChunkFiles): it reads the
shard index once, memory-maps the shard object and copies inner-chunk byte ranges into the
caller's buffer, verifying each inner chunk's crc32c the first time this process reads it (while
the file keeps its identity: inode, size, mtime). A read of several inner chunks copies them on
the reader's threads, each chunk checked by the thread that copies it, just before, while its
bytes are in the CPU's cache (crc32c and numpy's copy release the GIL): a first read costs about
one copy spread over the cores, not a copy plus a checksum pass. Anything else (compressed,
remote, another layout) goes through Zarr, whose crc32c codec checks each chunk it decodes.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import crc32c
import ml_dtypes
import numpy as np

from dflash_cache.format import fp8
from dflash_cache.format.cache_layout import checksum
from dflash_cache.settings.storage_config import LOSSLESS
from dflash_common.errors import CacheError

# Stored dtype of the hidden states, keyed by the true dtype recorded in the manifest. Zarr 3 has
# no bfloat16, so bf16 is stored as its 16-bit pattern and viewed back on read (lossless).
HIDDEN_STORAGE = {
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
}
HIDDEN_NUMPY = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}
# How the hidden states are encoded (the manifest's ``hidden_format``; absent means lossless).
# lossless: the true dtype's bits, as above. fp8_e4m3: uint8 e4m3 codes in hidden.zarr and one
# power-of-two scale exponent per token per layer in the scale column of tokens.arrow (see
# dflash_cache.format.fp8 and .tokens); the reader decodes them to the true dtype. The names
# (LOSSLESS, HIDDEN_FORMATS) are settings of a build: dflash_cache.settings.storage_config.


def stored_dtype(hidden_dtype: str, hidden_format: str = LOSSLESS) -> np.dtype:
    """The Zarr data type of the hidden-state array."""
    return fp8.CODE_DTYPE if hidden_format == fp8.FORMAT else HIDDEN_STORAGE[hidden_dtype]


def hidden_bytes_per_token(num_layers: int, hidden_size: int, hidden_dtype: str, hidden_format: str = LOSSLESS) -> int:
    """Stored hidden-state bytes per token, fp8 scale exponents included."""
    scales = num_layers * fp8.EXP_DTYPE.itemsize if hidden_format == fp8.FORMAT else 0
    return num_layers * hidden_size * stored_dtype(hidden_dtype, hidden_format).itemsize + scales


def from_storage(stored: np.ndarray, hidden_dtype: str) -> np.ndarray:
    """Reinterpret stored hidden states as their true dtype, without copying."""
    return stored.view(HIDDEN_NUMPY[hidden_dtype])


def encode_hidden(bits: np.ndarray, hidden_dtype: str, hidden_format: str) -> tuple[np.ndarray, dict, np.ndarray | None]:
    """A shard's hidden states [N, L, H] (the build dtype's bits) as stored: the array, the Zarr
    array's attributes, and (fp8) the per-token, per-layer scale exponents [N, L] that go into
    tokens.arrow."""
    attributes = {"dtype": hidden_dtype}
    if hidden_format != fp8.FORMAT:
        return bits, attributes, None
    codes, exponents = fp8.quantize(from_storage(bits, hidden_dtype))
    return codes, {**attributes, "format": fp8.FORMAT}, exponents


def decode_hidden(stored: np.ndarray, scale_exponents: np.ndarray | None, hidden_dtype: str,
                  hidden_format: str = LOSSLESS) -> np.ndarray:
    """Stored hidden-state rows (and, for fp8, their scale exponents) -> the true dtype. Lossless
    rows are reinterpreted without a copy; fp8 rows are decoded exactly (dflash_cache.format.fp8)."""
    if hidden_format == fp8.FORMAT:
        return fp8.dequantize(stored, scale_exponents, hidden_dtype)
    return from_storage(stored, hidden_dtype)


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

ZARR_JSON_BYTES = 1 << 20
"""The most of a hidden.zarr/zarr.json a reader takes (the writer's are under 2 KB)."""
EMPTY = 2**64 - 1


def read_zarr_json(path: str) -> bytes:
    """An array's zarr.json, refused unread past ZARR_JSON_BYTES (Zarr itself would read it whole)."""
    with open(os.path.join(path, "zarr.json"), "rb") as f:
        data = f.read(ZARR_JSON_BYTES + 1)
    if len(data) > ZARR_JSON_BYTES:
        raise CacheError(f"{path}/zarr.json is larger than {ZARR_JSON_BYTES >> 20} MiB (a writer's is under 2 KB), so it "
                         "was not read; the shard was edited: run `dflash-cache verify`, then rebuild or skip the shard")
    return data  # an inner chunk never written (zarr's marker); a build writes every one


class HiddenChecksumError(CacheError):
    """Stored hidden-state bytes differ from their crc32c (``problem`` says which); the reader turns
    it into the shard's integrity refusal."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")


def chunk_tokens_for(n_tokens: int, per_token: int, chunk_bytes: int) -> int:
    """Token rows per inner chunk: ``chunk_bytes`` worth, at least 1, at most the shard's tokens."""
    return max(1, min(max(n_tokens, 1), chunk_bytes // max(1, per_token)))


def write_hidden(store, hidden: np.ndarray, attributes: dict, chunk_bytes: int, compression: str) -> tuple[str, int]:
    """Write ``hidden`` [N, L, H] (its stored dtype) as one sharded Zarr array into the Zarr
    ``store``; returns the xxh64 of its logical bytes (``layout.checksum``) and the inner chunk's
    token rows."""
    import zarr
    import zarr.codecs

    n_tokens, n_layers, hidden_size = hidden.shape
    chunk_tokens = chunk_tokens_for(n_tokens, n_layers * hidden_size * hidden.dtype.itemsize, chunk_bytes)
    shard_rows = max(1, -(-n_tokens // chunk_tokens)) * chunk_tokens  # a whole number of inner chunks
    compressors = ([zarr.codecs.ZstdCodec(level=1)] if compression == "zstd" else []) + [zarr.codecs.Crc32cCodec()]
    with ThreadPoolExecutor(1) as hashing:  # xxh64 releases the GIL: hash while Zarr writes
        digest = hashing.submit(checksum, hidden)
        zarr.create_array(store, data=hidden, chunks=(chunk_tokens, n_layers, hidden_size),
                          shards=(shard_rows, n_layers, hidden_size), compressors=compressors,
                          attributes=attributes, config={"write_empty_chunks": True}, overwrite=True)
    return digest.result(), chunk_tokens


def zstd_content_size(frame) -> int | None:
    """The decompressed size a zstd frame's header declares (None: it declares none, or this is no
    zstd frame); read before anything is decompressed, so a frame claiming 64 GiB allocates nothing."""
    head = bytes(frame[:18])
    if len(head) < 6 or int.from_bytes(head[:4], "little") != 0xFD2FB528:
        return None
    descriptor = head[4]
    flag, single = descriptor >> 6, (descriptor >> 5) & 1
    size = (1 if single else 0, 2, 4, 8)[flag]
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3]
    if size == 0 or len(head) < at + size:
        return None
    return int.from_bytes(head[at:at + size], "little") + (256 if size == 2 else 0)


def _plain_sharded(meta: dict) -> dict | None:
    """The parameters of the layout ``write_hidden`` makes (with or without zstd), or None."""
    codecs = meta.get("codecs") or []
    grid = meta.get("chunk_grid") or {}
    keys = meta.get("chunk_key_encoding") or {}
    shape = meta.get("shape")
    if not (meta.get("zarr_format") == 3 and len(codecs) == 1 and codecs[0].get("name") == "sharding_indexed"
            and grid.get("name") == "regular" and keys.get("name") == "default"
            and keys.get("configuration", {}).get("separator", "/") == "/" and not meta.get("storage_transformers")
            and sys.byteorder == "little" and meta.get("data_type") in ("uint8", "uint16", "float32")
            and isinstance(shape, list) and len(shape) == 3):
        return None
    config = codecs[0].get("configuration") or {}
    shard_shape = grid.get("configuration", {}).get("chunk_shape")
    inner = config.get("chunk_shape")
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    codecs = config.get("codecs") or []
    zstd = len(codecs) == 3 and isinstance(codecs[1], dict) and codecs[1].get("name") == "zstd"
    if zstd:
        codecs = [codecs[0], codecs[2]]
    if (codecs != [little, {"name": "crc32c"}] or config.get("index_codecs") != [little, {"name": "crc32c"}]
            or config.get("index_location", "end") != "end" or not isinstance(shard_shape, list)
            or not isinstance(inner, list) or len(inner) != 3 or shard_shape[1:] != shape[1:] or inner[1:] != shape[1:]
            or shard_shape[0] < shape[0] or inner[0] < 1 or shard_shape[0] % inner[0]):
        return None
    return {"shape": tuple(shape), "shard_rows": int(shard_shape[0]), "chunk_rows": int(inner[0]),
            "dtype": np.dtype(meta["data_type"]), "zstd": zstd}


_VERIFIED: set[tuple] = set()  # (path, inode, size, mtime_ns, inner chunk) whose crc32c matched
_VERIFIED_LOCK = threading.Lock()
CHECK_THREADS = 2
"""Threads that copy a read's inner chunks, checking each chunk's crc32c first (per process)."""
_CHECKER: ThreadPoolExecutor | None = None


def _checker() -> ThreadPoolExecutor:
    global _CHECKER
    with _VERIFIED_LOCK:
        if _CHECKER is None:
            _CHECKER = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="crc32c")
        return _CHECKER


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a rank) has none of its parent's threads: a lock one of
    them held at the fork would stay held forever, and the checker threads are gone."""
    global _VERIFIED_LOCK, _CHECKER
    _VERIFIED_LOCK, _CHECKER = threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork_in_child)


class ShardedHidden:
    """Rows of a format-2 hidden-state array on local disk, read straight from its memory-mapped
    shard object (see the module's docstring). zstd inner chunks are decompressed here into a buffer
    of exactly the chunk's size, after their crc32c and their frame's declared size are checked:
    nothing a shard claims is allocated before it is checked against the array's shape."""

    def __init__(self, path: str, shape: tuple[int, ...], shard_rows: int, chunk_rows: int, dtype: np.dtype,
                 zstd: bool = False):
        self.path, self.shape, self.chunk_rows, self.dtype, self.zstd = path, shape, chunk_rows, dtype, zstd
        self._decoded: tuple[tuple, np.ndarray] | None = None  # the last zstd chunk decoded: (key, rows)
        self.data_path = os.path.join(path, "c", "0", "0", "0")
        self.n_chunks = shard_rows // chunk_rows
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self._lock = threading.Lock()
        self._mapped: tuple | None = None  # (identity, data, index)

    @classmethod
    def open(cls, path: str) -> "ShardedHidden | None":
        try:
            meta = json.loads(read_zarr_json(path))
        except (OSError, ValueError):
            return None  # Zarr gives the precise error on the slow path
        layout = _plain_sharded(meta) if isinstance(meta, dict) else None
        if layout is None:
            return None
        return cls(path, layout["shape"], layout["shard_rows"], layout["chunk_rows"], layout["dtype"], layout["zstd"])

    def _damaged(self, problem: str) -> HiddenChecksumError:
        return HiddenChecksumError(self.data_path, problem)

    def _map(self) -> tuple:
        """(identity, bytes, index [n_chunks, 2]) of the shard object, the index's crc32c checked;
        mapped again when the file changed."""
        try:
            info = os.stat(self.data_path)
        except FileNotFoundError:
            raise CacheError(f"{self.data_path}: the hidden-state file of a committed shard is missing; the shard is "
                             "damaged (run `dflash-cache verify`, then rebuild or skip the shard)") from None
        identity = (self.data_path, info.st_ino, info.st_size, info.st_mtime_ns)
        with self._lock:
            if self._mapped is not None and self._mapped[0] == identity:
                return self._mapped
            index_bytes = self.n_chunks * 16 + 4
            if info.st_size < index_bytes:
                raise self._damaged(f"is {info.st_size} bytes, shorter than its shard index ({index_bytes})")
            with open(self.data_path, "rb") as f:
                data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
            raw = data[info.st_size - index_bytes:]
            if crc32c.crc32c(raw[:-4]) != int(raw[-4:].view("<u4")[0]):
                raise self._damaged("shard index crc32c mismatch")
            index = raw[:-4].view("<u8").reshape(self.n_chunks, 2).astype(np.int64, copy=False)
            want = self.chunk_rows * self.row_bytes + 4
            lengths = index[:, 1]
            wrong = ((lengths < 5) | (lengths > want + (want >> 4) + 1024)) if self.zstd else lengths != want
            bad = np.flatnonzero(wrong | (index[:, 0] < 0) | (index[:, 0] + lengths > info.st_size - index_bytes))
            if len(bad):
                what = "a compressed inner chunk" if self.zstd else f"an inner chunk of {want} bytes"
                raise self._damaged(f"shard index entry {int(bad[0])} is not {what} inside the file")
            if self.zstd:  # every frame must declare the chunk's size: nothing larger is ever allocated
                declared = [zstd_content_size(data[offset:offset + 18]) for offset in index[:, 0].tolist()]
                wrong = [i for i, size in enumerate(declared) if size != want - 4]
                if wrong:
                    raise self._damaged(f"inner chunk {wrong[0]} declares {declared[wrong[0]]} decompressed bytes, not "
                                        f"the chunk's {want - 4:,}")
            self._mapped = (identity, data, index)
            return self._mapped

    def _chunk(self, number: int, mapped: tuple, force: bool = False) -> np.ndarray:
        """Inner chunk ``number``'s payload, its crc32c checked (once per file identity unless ``force``)."""
        payload, key = self._payload(number, mapped)
        if force or key not in _VERIFIED:
            self._check(number, mapped)
        return self._decompress(payload, key) if self.zstd else payload

    def _payload(self, number: int, mapped: tuple) -> tuple[np.ndarray, tuple]:
        """(inner chunk ``number``'s stored bytes, unchecked; its key in _VERIFIED)."""
        identity, data, index = mapped
        offset, length = int(index[number, 0]), int(index[number, 1])
        return data[offset:offset + length - 4], (*identity, number)

    def _check(self, number: int, mapped: tuple) -> None:
        """Raise HiddenChecksumError unless inner chunk ``number``'s bytes match their crc32c."""
        identity, data, index = mapped
        end = int(index[number, 0]) + int(index[number, 1])
        payload, key = self._payload(number, mapped)
        if crc32c.crc32c(payload) != int(data[end - 4:end].view("<u4")[0]):
            raise self._damaged(f"inner chunk {number} (token rows {number * self.chunk_rows}..) crc32c mismatch")
        with _VERIFIED_LOCK:
            _VERIFIED.add(key)

    def _decompress(self, payload: np.ndarray, key: tuple) -> np.ndarray:
        """A zstd inner chunk's rows, decompressed into exactly the chunk's bytes (its frame must
        declare that size); the last one decoded is kept for the next read of the same chunk."""
        from numcodecs import Zstd

        decoded = self._decoded
        if decoded is not None and decoded[0] == key:
            return decoded[1]
        out = np.empty(self.chunk_rows * self.row_bytes, np.uint8)  # each frame's size was checked by _map
        try:
            Zstd().decode(payload, out=out)
        except (RuntimeError, ValueError) as err:
            raise self._damaged(f"inner chunk {key[-1]} does not decompress ({str(err)[:80]})") from None
        self._decoded = (key, out)
        return out

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows start..stop (clipped to the array, as a slice is), into ``out`` when given (a
        C-contiguous array of those rows' shape and this array's item size). Several plain chunks are
        copied on the checker threads, each checked first if this process has not checked it yet,
        and nothing returns before every check passed (a damaged chunk raises, whatever ``out``
        already received)."""
        start, stop = max(0, start), min(stop, self.shape[0])
        out = rows_out(self.shape, self.dtype, start, stop, out)
        if stop <= start:
            return out
        dest = out.reshape(-1).view(np.uint8)
        mapped = self._map()
        pieces = []  # per inner chunk: (number, its first and last row + 1 read, the row in out)
        row = start
        while row < stop:
            number, lo = divmod(row, self.chunk_rows)
            hi = min(self.chunk_rows, lo + stop - row)
            pieces.append((number, lo, hi, row - start))
            row += hi - lo
        if self.zstd or len(pieces) < 2:  # one decoded zstd chunk is kept: decode them in turn
            for piece in pieces:
                self._copy(piece, mapped, dest)
            return out
        copies = [_checker().submit(self._copy, piece, mapped, dest) for piece in pieces]
        wait(copies)  # every copy ends before a damaged chunk raises: none writes into ``out`` after
        for copy in copies:
            copy.result()
        return out

    def _copy(self, piece: tuple, mapped: tuple, dest: np.ndarray) -> None:
        """Inner chunk ``number``'s rows lo..hi into the bytes ``dest`` from row ``at`` on, the
        chunk checked first unless this process checked it already."""
        number, lo, hi, at = piece
        rows = self._chunk(number, mapped)
        dest[at * self.row_bytes:(at + hi - lo) * self.row_bytes] = rows[lo * self.row_bytes:hi * self.row_bytes]

    def check_all(self):
        """Every inner chunk's crc32c, checked now (``verify``); yields each chunk's logical rows as
        uint8, in order."""
        if self.shape[0] == 0:
            return
        mapped = self._map()
        for number in range(-(-self.shape[0] // self.chunk_rows)):
            payload = self._chunk(number, mapped, force=True)
            rows = min(self.chunk_rows, self.shape[0] - number * self.chunk_rows)
            yield payload[:rows * self.row_bytes]
