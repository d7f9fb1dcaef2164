"""The public way to read a cache: ``open_cache(url)``.

Only shards listed in the manifest are visible, and a shard is listed only after its commit
record exists, so a half-written shard can never be read. Per-token arrays are zero-copy views of
memory-mapped Arrow files on local storage. Hidden states of uncompressed local shards are read
straight from their Zarr chunk files (``ChunkFiles``); compressed or remote ones go through Zarr.
``Cache.read_ahead`` reads the sequences a caller will ask for next on background threads, within
a byte budget: the prefetch from object stores.

Nothing read from manifest.json is trusted as a path: every shard record is checked by
``format.check_shard_paths`` when the cache is opened, and on local storage a shard folder or
file that is a symlink resolving outside the cache is refused. ``Shard.checksum_problems``
compares a shard's bytes with the checksums of its commit record, hashing each shard's files once
per process (the training loader calls it before it hands out anything of a shard).
``Cache.ensure_intact`` is the one check by which training and evaluation refuse damaged shards.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Collection, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import xxhash
import zarr

from dflash_cache import format as fmt
from dflash_cache.writer import zarr_store
from dflash_common.errors import CacheError, ConfigError
from dflash_common.settings_files import load_settings_file


@dataclass(frozen=True)
class SequenceRecord:
    """One cached sequence. ``hidden[t, i]`` is tapped layer ``layer_ids[i]`` at position t;
    ``topk_*[t]`` describe the teacher's distribution of the token after position t."""

    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    hidden: np.ndarray  # [T, n_layers, H], bfloat16 (ml_dtypes) or float32
    topk_ids: np.ndarray  # int32 [T, k]
    topk_logprobs: np.ndarray  # float32 [T, k]

    def __len__(self) -> int:
        return len(self.input_ids)


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
        shape = (max(0, stop - start), *self.shape[1:])
        if out is None:
            out = np.empty(shape, dtype=self.dtype)
        elif out.shape != shape or out.dtype.itemsize != self.dtype.itemsize or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous, of shape {shape} and {self.dtype.itemsize}-byte items, "
                             f"got {out.dtype} {out.shape}")
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
            data = _mapped(path, info.st_ino, info.st_size, info.st_mtime_ns)
            first, last = lo * self.row_bytes, hi * self.row_bytes
            if len(data) < last:
                raise CacheError(f"{path}: chunk file is short ({max(0, len(data) - first)} of {last - first} bytes at "
                                 f"row {lo}); the shard is damaged (run `dflash-cache verify --deep`, then rebuild "
                                 "or skip the shard)")
            dest[(row - start) * self.row_bytes:(row - start + hi - lo) * self.row_bytes] = data[first:last]
            row += hi - lo
        return out


@lru_cache(maxsize=64)
def _mapped(path: str, inode: int, size: int, mtime_ns: int) -> np.ndarray:
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


def _fixed_list_values(table: pa.Table, column: str, k: int, field: str, where: str) -> np.ndarray:
    problem = list_width_problem(table, column, k, field)
    if problem:
        raise CacheError(f"{where}: {problem}; the manifest or the shard is damaged or edited: run `dflash-cache verify`, "
                         "then rebuild the cache (or restore manifest.json)")
    return table.column(column).combine_chunks().values.to_numpy(zero_copy_only=True).reshape(-1, k)


SIZES = "sizes"
"""Not a file: every file's size against its commit record, from one listing (``quick_check``)."""
CHECKSUMMED = (fmt.SEQUENCES, fmt.TOKENS, "hidden")
"""A shard's parts that its commit record holds checksums of (``Shard.checksum_problems``)."""


class Shard:
    """A committed shard: its sequence table, token table and hidden-state array."""

    def __init__(self, cache: "Cache", record: dict):
        self.cache, self.record, self.name = cache, record, record["name"]
        self.path = fmt.join(cache.root, fmt.SHARDS_DIR, self.name)
        self._checked: dict[str, list[str]] = {}  # part -> its problems, once checked
        self._check_lock = threading.Lock()

    def checksum_problems(self, parts: Sequence[str] = (fmt.SEQUENCES, fmt.TOKENS, "hidden")) -> list[str]:
        """What differs between this shard's files and the checksums of its commit record (empty
        when intact): ``parts`` of sequences.arrow, tokens.arrow and "hidden" (the hidden-state
        array as stored, its shape and dtype included). Each part is hashed once per shard object
        and, on local storage, once per process while its files stay the same (a file replaced or
        rewritten since is hashed again). Thread-safe; files are streamed, never loaded whole."""
        problems = []
        for part in parts:
            with self._check_lock:
                if part not in self._checked:
                    # a manifest edited to other counts keeps every checksum: its records are
                    # checked as `verify` checks them (the commit record first, the counts once
                    # the bytes are known to be the ones written)
                    self._checked[part] = ((record_problems(self, RECORD) if part == fmt.SEQUENCES else [])
                                           or _check_part(self, part) or record_problems(self, part))
                problems += self._checked[part]
        return problems

    def ensure_intact(self, parts: Sequence[str] = (fmt.SEQUENCES, fmt.TOKENS, "hidden")) -> None:
        """Raise ShardIntegrityError when ``checksum_problems(parts)`` finds any."""
        problems = self.checksum_problems(parts)
        if problems:
            raise ShardIntegrityError(self.cache.url, self.name, problems)

    @cached_property
    def _sequences(self) -> pa.Table:
        return open_ipc(self.cache.fs, fmt.join(self.path, fmt.SEQUENCES))

    @cached_property
    def _tokens(self) -> dict[str, np.ndarray]:
        table = open_ipc(self.cache.fs, fmt.join(self.path, fmt.TOKENS))
        k, where = self.cache.top_k, f"{self.cache.url}: shard {self.name}"
        tokens = {
            "input_ids": table.column("input_ids").combine_chunks().to_numpy(zero_copy_only=True),
            "loss_mask": table.column("loss_mask").combine_chunks().to_numpy(zero_copy_only=True),
            "topk_ids": _fixed_list_values(table, "topk_ids", k, "top_k", where),
            "topk_logprobs": _fixed_list_values(table, "topk_logprobs", k, "top_k", where),
        }
        if self.cache.hidden_format != fmt.LOSSLESS:  # fp8: the hidden states' scale exponents
            tokens[fmt.SCALE_COLUMN] = _fixed_list_values(table, fmt.SCALE_COLUMN, len(self.cache.layer_ids),
                                                          "layer_ids", where)
        return tokens

    @cached_property
    def hidden_array(self) -> zarr.Array:
        return zarr.open_array(zarr_store(self.cache.fs, fmt.join(self.path, fmt.HIDDEN), read_only=True), mode="r")

    @cached_property
    def ids(self) -> list[str]:
        return self._sequences.column("id").to_pylist()

    @cached_property
    def offsets(self) -> np.ndarray:
        return self._sequences.column("offset").to_numpy()

    @cached_property
    def lengths(self) -> np.ndarray:
        return self._sequences.column("length").to_numpy()

    def __len__(self) -> int:
        return int(self.record["sequences"])

    @cached_property
    def _chunk_files(self) -> "ChunkFiles | None":
        if not fmt.is_local(self.cache.fs):
            return None
        return ChunkFiles.open(fmt.join(self.path, fmt.HIDDEN))

    def read_stored(self, start: int, stop: int) -> np.ndarray:
        """Token rows start..stop of the hidden-state array exactly as stored (e.g. uint16 for bf16).
        Uncompressed local shards are read straight from their chunk files; anything else goes
        through Zarr."""
        if self._chunk_files is not None:
            return self._chunk_files.read(start, stop)
        return self.hidden_array[start:stop]

    def read_hidden(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Hidden states of token rows start..stop of this shard, in their true dtype (fp8 shards
        decoded with their scales). With ``out`` (that shape and dtype) they are written there:
        uncompressed lossless local shards read straight into it, with no copy in between."""
        cache = self.cache
        if out is not None and cache.hidden_format == fmt.LOSSLESS and self._chunk_files is not None:
            self._chunk_files.read(start, stop, out)
            return out
        scales = self._tokens[fmt.SCALE_COLUMN][start:stop] if cache.hidden_format != fmt.LOSSLESS else None
        hidden = fmt.decode_hidden(self.read_stored(start, stop), scales, cache.hidden_dtype, cache.hidden_format)
        if out is None:
            return hidden
        out[...] = hidden
        return out

    def _record(self, i: int, hidden: np.ndarray) -> SequenceRecord:
        start, length = int(self.offsets[i]), int(self.lengths[i])
        tokens = self._tokens
        return SequenceRecord(
            id=self.ids[i],
            input_ids=tokens["input_ids"][start:start + length],
            loss_mask=tokens["loss_mask"][start:start + length],
            hidden=hidden,
            topk_ids=tokens["topk_ids"][start:start + length],
            topk_logprobs=tokens["topk_logprobs"][start:start + length],
        )

    def __getitem__(self, i: int) -> SequenceRecord:
        return self.read(i)

    def read(self, i: int, out: np.ndarray | None = None) -> SequenceRecord:
        """Sequence i, its hidden states read into ``out`` when given ([T, n_layers, H], the
        reader's dtype: e.g. a row of a padded batch)."""
        start, length = int(self.offsets[i]), int(self.lengths[i])
        return self._record(i, self.read_hidden(start, start + length, out))

    def records(self, window_bytes: int = 64 * 2**20) -> Iterator[SequenceRecord]:
        """All sequences in order, reading hidden states in large windows rather than per sequence."""
        n = len(self)
        if n == 0:
            return
        per_token = max(1, self.cache.hidden_bytes_per_token)
        window_tokens = max(1, window_bytes // per_token)
        offsets, lengths = self.offsets, self.lengths
        i = 0
        while i < n:
            start = int(offsets[i])
            j = i + 1
            while j < n and int(offsets[j] + lengths[j]) - start <= window_tokens:
                j += 1
            stop = int(offsets[j - 1] + lengths[j - 1])
            window = self.read_hidden(start, stop)
            for s in range(i, j):
                lo = int(offsets[s]) - start
                yield self._record(s, window[lo:lo + int(lengths[s])])
            i = j


class Cache:
    """A dflash cache opened for reading. Build one with ``open_cache``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url
        self.fs, self.root = fmt.url_to_fs(url, storage_options)
        self.manifest = fmt.read_manifest(self.fs, self.root, url)
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.hidden_dtype: str = self.manifest["hidden_dtype"]
        self.hidden_format: str = fmt.hidden_format_of(self.manifest)
        self.top_k: int = int(self.manifest["top_k"])
        records = self.manifest["shards"]
        if not isinstance(records, list):
            raise CacheError(f"{url}: manifest.json's shards is a {type(records).__name__}, not a list; the manifest is "
                             "not trustworthy, rebuild the cache with `dflash-cache build ... --overwrite`")
        for record in records:  # names become paths below: none may leave the cache
            fmt.check_shard_paths(record, url)
        self.shards = [Shard(self, record) for record in records]
        if fmt.is_local(self.fs):
            self._refuse_outside_links()

    def _refuse_outside_links(self) -> None:
        """On local storage: refuse a shards folder, shard folder or commit record that is a
        symlink resolving outside the cache (one lstat a shard; the files inside a shard are
        checked where they are read: ``refuse_outside_links``)."""
        root = os.path.realpath(self.root)
        shards_dir = os.path.join(self.root, fmt.SHARDS_DIR)
        _inside(root, shards_dir, self.url)
        for shard in self.shards:
            for path in (os.path.join(shards_dir, shard.name), os.path.join(shards_dir, f"{shard.name}.json")):
                if os.path.islink(path):
                    _inside(root, path, self.url)

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @cached_property
    def fingerprint(self) -> str:
        """The cache's identity: teacher, tokenizer, layers, k, dtype and the committed shards'
        checksums. A checkpoint records it, so a run resumes only on the cache it trained on."""
        keys = ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype")
        shards = [(s["name"], s["checksums"]) for s in self.manifest["shards"]]
        payload = json.dumps([{k: self.manifest.get(k) for k in keys}, shards], sort_keys=True)
        return xxhash.xxh64(payload.encode()).hexdigest()

    @property
    def hidden_bytes_per_token(self) -> int:
        return fmt.hidden_bytes_per_token(len(self.layer_ids), self.hidden_size, self.hidden_dtype)

    def padded_hidden(self, lengths: Sequence[int], pinned: bool = False) -> np.ndarray:
        """Zeros [len(lengths), max(lengths), n_layers, H] in the dtype the reader hands out: a
        batch to read sequences straight into, ``shard.read(i, out=batch[row, :length])``.
        ``pinned`` allocates it in page-locked memory (needs CUDA), so a CUDA trainer copies it to
        the GPU as it is instead of pinning a second copy of every batch."""
        shape = (len(lengths), max(lengths, default=0), len(self.layer_ids), self.hidden_size)
        dtype = np.dtype(fmt.HIDDEN_NUMPY[self.hidden_dtype])
        if not pinned:
            return np.zeros(shape, dtype=dtype)
        import torch

        raw = torch.zeros((*shape, dtype.itemsize), dtype=torch.uint8, pin_memory=True)
        return raw.numpy().view(dtype).reshape(shape)

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.record["tokens"]) for s in self.shards)

    def sequences(self) -> Iterator[SequenceRecord]:
        for shard in self.shards:
            yield from shard.records()

    def read_ahead(self, refs: Iterable[tuple], max_bytes: int = 256 * 2**20, threads: int = 4,
                   check: bool = False) -> "ReadAhead":
        """The records of ``refs`` ((shard index, sequence index) pairs, or (shard, sequence, out)
        to read the hidden states into ``out`` as ``Shard.read`` does), in order. Background
        threads read the upcoming ones while the caller works on earlier ones: on an object store
        this is the prefetch of what comes next, locally it overlaps the reads with the caller's
        work. ``max_bytes`` bounds the hidden-state bytes read but not yet handed out (a sequence
        larger than that is still read, alone). With ``check`` no record of a shard is handed out
        before the shard passed ``Shard.ensure_intact`` (hashed on the reading threads, once)."""
        return ReadAhead(self, refs, max_bytes, threads, check)

    def checksum_problems(self, shards: Iterable[int], parts: Sequence[str] = (fmt.SEQUENCES, fmt.TOKENS, "hidden"),
                          threads: int = 4) -> dict[str, list[str]]:
        """``Shard.checksum_problems`` of the shards at these indices, several hashed at once:
        shard name -> problems, for the damaged ones only."""
        shards = [self.shards[i] for i in dict.fromkeys(shards)]
        if sum(not s._checked.keys() >= set(parts) for s in shards) > 1 and threads > 1:
            with ThreadPoolExecutor(min(threads, len(shards)), thread_name_prefix="dflash-checksum") as pool:
                found = list(pool.map(lambda s: s.checksum_problems(parts), shards))
        else:
            found = [s.checksum_problems(parts) for s in shards]
        return {s.name: p for s, p in zip(shards, found) if p}

    def ensure_intact(self, parts: Sequence[str] = CHECKSUMMED, shards: Iterable[int] | None = None,
                      skip: Collection[str] = (), threads: int = 4) -> int:
        """The one integrity check by which training and evaluation refuse damaged shards: refuses
        ``skip`` names (--skip-shards) the cache does not list (ConfigError), then every shard at
        the indices ``shards`` (default: each one not skipped) whose ``parts`` fail, in one line
        naming each with its first problem and both ways out (CacheError). Parts: SIZES (one
        listing of shards/: missing folders and files, sizes other than the commit records';
        cheap enough for every start) and the checksummed ones (``Shard.checksum_problems``, each
        shard hashed once per process). Returns the number of sequences the skipped shards hold."""
        listed = {s.name: len(s) for s in self.shards}
        unknown = [name for name in skip if name not in listed]
        if unknown:
            raise ConfigError(f"--skip-shards names {unknown}, which {self.url} does not list; take names from "
                              "`dflash-cache verify` or `dflash-cache info --json`")
        chosen = [i for i, s in enumerate(self.shards) if s.name not in skip] if shards is None else list(shards)
        names = {self.shards[i].name for i in chosen}
        problems = {name: bad for name, bad in quick_check(self, set(skip)).items() if name in names} if SIZES in parts else {}
        checksummed = [part for part in parts if part != SIZES]
        if checksummed:
            problems.update(self.checksum_problems([i for i in chosen if self.shards[i].name not in problems],
                                                   checksummed, threads))
        if problems:
            raise CacheError(damaged_shards_message(self.url, problems))
        return sum(listed[name] for name in set(skip))

    def sequence_bytes(self, shard: int, i: int) -> int:
        """Bytes of one sequence's hidden states as the reader hands them out."""
        return int(self.shards[shard].lengths[i]) * self.hidden_bytes_per_token

    @cached_property
    def _index(self) -> dict[str, tuple[int, int]]:
        index = {}
        for si, shard in enumerate(self.shards):
            for i, seq_id in enumerate(shard.ids):
                index[seq_id] = (si, i)
        return index

    def locate(self, seq_id: str) -> tuple[Shard, int]:
        try:
            si, i = self._index[seq_id]
        except KeyError:
            raise KeyError(f"no sequence with id {seq_id!r} in {self.url}") from None
        return self.shards[si], i

    def __getitem__(self, seq_id: str) -> SequenceRecord:
        shard, i = self.locate(seq_id)
        return shard[i]

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._index

    # --- the teacher's frozen pieces ------------------------------------------------------------

    def teacher_path(self, name: str) -> str:
        return fmt.join(self.root, fmt.TEACHER_DIR, name)

    @property
    def chat_template_kwargs(self) -> dict | None:
        """The chat-template variables the corpus was rendered with at build (None: the template's defaults)."""
        return (self.manifest.get("content_options") or {}).get("chat_template_kwargs")

    def teacher_config(self) -> dict:
        what = f"{self.url}: {fmt.TEACHER_DIR}/config.json"
        values = load_settings_file(self.teacher_path("config.json"), what, "json", error=CacheError,
                                    fix="rebuild the cache", fs=self.fs)
        if not isinstance(values, dict):
            raise CacheError(f"{what} holds a JSON {type(values).__name__}, not a model config; rebuild the cache")
        return values

    def load_teacher_head(self, device: str = "cpu") -> dict:
        """{'embed_tokens.weight': [V, H], 'lm_head.weight': [V, H]} as torch tensors, checked: the
        file against the checksum the manifest records (when it records one), each tensor for a
        floating dtype and for NaN/Inf. A drafter trains on this head frozen, so a damaged one
        would train silently into a useless drafter; any problem is one CacheError line."""
        import safetensors.torch
        import torch
        from safetensors import SafetensorError

        path = self.teacher_path(fmt.TEACHER_HEAD)
        where = f"{self.url}: {fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD}"
        fix = "rebuild the cache with `dflash-cache build ... --overwrite` (or restore the file)"
        if not self.fs.exists(path):
            raise CacheError(f"{where} (the teacher head) is missing; {fix}")
        data = self.fs.cat_file(path)
        problem = fmt.teacher_head_problem(data, self.manifest.get("teacher_head"))
        if problem:
            raise CacheError(f"{where} {problem}; {fix}")
        try:
            tensors = safetensors.torch.load(data)
        except (SafetensorError, ValueError, RuntimeError) as err:
            raise CacheError(f"{where} is not a readable safetensors file ({str(err)[:120]}); {fix}") from None
        for name in fmt.TEACHER_HEAD_TENSORS:
            tensor = tensors.get(name)
            if tensor is None:
                raise CacheError(f"{where} lacks the tensor {name!r}; {fix}")
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in fmt.TEACHER_HEAD_DTYPES:
                raise CacheError(f"{where} holds {name} as {dtype}; a teacher head is {', '.join(fmt.TEACHER_HEAD_DTYPES)} "
                                 f"(the drafter uses it as it is): {fix}")
            # in row blocks: a boolean mask of a production head at once would be another 1.3 GB
            bad = sum(int((~torch.isfinite(rows)).sum()) for rows in tensor.split(8192))
            if bad:
                raise CacheError(f"{where} holds {bad:,} NaN/Inf value(s) in {name}; {fix}")
        return {k: v.to(device) for k, v in tensors.items()}

    def load_tokenizer(self):
        """The teacher's tokenizer as saved in the cache."""
        import tempfile

        from transformers import AutoTokenizer

        if fmt.is_local(self.fs):
            # a cache may come from anyone: its tokenizer folder never runs code
            return AutoTokenizer.from_pretrained(self.teacher_path(""), trust_remote_code=False)
        with tempfile.TemporaryDirectory() as tmp:
            self.fs.get(self.teacher_path("") + "/", tmp + "/", recursive=True)
            return AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)


class ReadAhead:
    """Iterator of records read ahead on a thread pool within a byte budget (``Cache.read_ahead``).
    ``peak_bytes`` is the most that was ever read ahead and not yet handed out."""

    def __init__(self, cache: Cache, refs: Iterable[tuple], max_bytes: int, threads: int, check: bool = False):
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


class ShardIntegrityError(CacheError):
    """A shard's bytes differ from its commit record (``Shard.ensure_intact``); ``problems`` say how."""

    def __init__(self, url: str, shard: str, problems: list[str]):
        self.url, self.shard, self.problems = url, shard, list(problems)
        super().__init__(damaged_shards_message(url, {shard: self.problems}))


def damaged_shards_message(url: str, problems: dict[str, list[str]]) -> str:
    """One line naming every damaged shard, its first problem, and both ways out."""
    named = "; ".join(f"{name} ({bad[0]}" + (f", +{len(bad) - 1} more" if len(bad) > 1 else "") + ")"
                      for name, bad in problems.items())
    return (f"{url}: {len(problems)} shard(s) fail the integrity check: {named}; run `dflash-cache verify {url}` "
            f"and rebuild the cache, or train without them with --skip-shards {','.join(problems)}")


def size_problems(expected: dict[str, int], found: dict[str, int] | None) -> list[str]:
    """Files of a commit record (relative path -> bytes) against those found; None: no folder."""
    if found is None:
        return ["shard folder missing"]
    problems = []
    for name, size in expected.items():
        if name not in found:
            problems.append(f"file {name} missing")
        elif found[name] != size:
            problems.append(f"file {name} is {found[name]} bytes, expected {size}")
    return problems


def quick_check(cache: Cache, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, list[str]]:
    """Problems of every listed shard (except ``skip``) that one listing of ``shards/`` shows:
    missing folders and files, and sizes that differ from the commit records; a symlink in it
    that leaves the cache is refused (CacheError). Cheap enough to run whenever a cache is opened
    for training; the loader checks a shard's checksums when it first reads it
    (``Shard.checksum_problems``), verify checks everything."""
    shards_dir = fmt.join(cache.root, fmt.SHARDS_DIR)
    try:
        listing = cache.fs.find(shards_dir, detail=True) if cache.fs.exists(shards_dir) else {}
    except FileNotFoundError:
        listing = {}
    found: dict[str, dict[str, int]] = {}
    prefix = len(shards_dir) + 1
    linked = {}
    for path, info in listing.items():
        if info.get("islink"):  # the listing names links without following them: none may leave the cache
            refuse_outside_links(cache, path)
            if fmt.is_local(cache.fs) and os.path.isdir(path):  # a shard folder linked from inside the cache
                linked.update(cache.fs.find(path, detail=True))
    for path, info in {**listing, **linked}.items():
        shard, _, rest = path[prefix:].partition("/")
        if rest:
            found.setdefault(shard, {})[rest] = int(info["size"])
    problems = {}
    for shard in cache.shards:
        if shard.name not in skip:
            bad = size_problems(shard.record["files"], found.get(shard.name))
            if bad:
                problems[shard.name] = bad
    return problems


def _inside(root: str, path: str, url: str) -> None:
    """Refuse ``path`` when it resolves (symlinks followed) outside the real folder ``root``."""
    target = os.path.realpath(path)
    if os.path.commonpath([root, target]) != root:
        raise CacheError(f"{url}: {path} is a symlink to {target}, outside the cache; the cache is not trustworthy "
                         "(a cache holds its own files): replace the link with the files it points to, or rebuild the "
                         "cache with `dflash-cache build ... --overwrite`")


def refuse_outside_links(cache: Cache, path: str) -> None:
    """On local storage: refuse any symlink at or under ``path`` of ``cache`` (files and folders,
    at any depth) that resolves outside the cache."""
    if fmt.is_local(cache.fs):
        _local_files(cache, path)


def _local_files(cache: Cache, path: str) -> list[tuple]:
    """(path, inode, size, mtime) of the local file ``path`` or of every file under the folder
    ``path``, in one pass that refuses any symlink resolving outside the cache. A missing path is
    FileNotFoundError."""
    root = os.path.realpath(cache.root)
    if os.path.islink(path):
        _inside(root, path, cache.url)
    if not os.path.isdir(path):
        return [(path, *_identity(path))]
    found, folders = [], [path]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    _inside(root, entry.path, cache.url)
                if entry.is_dir():
                    folders.append(entry.path)
                else:
                    info = entry.stat()
                    found.append((entry.path, info.st_ino, info.st_size, info.st_mtime_ns))
    return sorted(found)


# Parts of local shards already hashed in this process: (part, path, identity of its files,
# expected checksum) -> problems. The identity is a hash of (inode, size, mtime) of every file, so
# a file rewritten or replaced since is hashed again.
_VERIFIED: dict[tuple, list[str]] = {}
_VERIFIED_LOCK = threading.Lock()
HASH_WINDOW = 64 * 2**20  # bytes hashed at a time when the hidden states go through Zarr


RECORD = "record"  # a shard's commit record (shards/NAME.json), as a part of record_problems


def record_problems(shard: Shard, part: str) -> list[str]:
    """Where one part of a shard disagrees with its record (empty when it agrees; checksums are
    ``_check_part``'s): for RECORD, the commit record on disk against the manifest's; for
    sequences.arrow, the sequence count, offsets and lengths against the record; for tokens.arrow,
    the token count and the top-k width against the manifest. The one check of these, run by the
    training loader (``Shard.checksum_problems``) and by `dflash-cache verify` alike. Errors
    become problems."""
    cache, record = shard.cache, shard.record
    try:
        if part == RECORD:
            record_path = f"{shard.path}.json"
            if not cache.fs.exists(record_path):
                return ["commit record missing"]
            try:
                on_disk = fmt.read_json(cache.fs, record_path)
            except (ValueError, CacheError):
                return ["commit record is not readable JSON"]
            fmt.check_shard_paths(on_disk, cache.url, f"{fmt.SHARDS_DIR}/{shard.name}.json")
            if on_disk != record:
                differ = sorted(k for k in {**on_disk, **record} if on_disk.get(k) != record.get(k))
                return [f"commit record differs from the manifest ({', '.join(differ)})"]
        elif part == fmt.SEQUENCES:
            sequences = open_ipc(cache.fs, fmt.join(shard.path, fmt.SEQUENCES))
            if sequences.num_rows != record["sequences"]:
                return [f"{fmt.SEQUENCES} holds {sequences.num_rows} sequences, the record {record['sequences']}"]
            lengths = sequences.column("length").to_numpy()
            offsets = sequences.column("offset").to_numpy()
            if len(lengths) and (offsets[0] != 0 or np.any(offsets[1:] != np.cumsum(lengths)[:-1])
                                 or lengths.sum() != record["tokens"] or np.any(lengths < 0)):
                return ["sequence offsets and lengths are inconsistent"]
        elif part == fmt.TOKENS:
            tokens = open_ipc(cache.fs, fmt.join(shard.path, fmt.TOKENS))
            if tokens.num_rows != record["tokens"]:
                return [f"{fmt.TOKENS} holds {tokens.num_rows} tokens, the record {record['tokens']}"]
            for column in ("topk_ids", "topk_logprobs"):
                problem = list_width_problem(tokens, column, cache.top_k, "top_k")
                if problem:
                    return [problem]
    except CacheError:
        raise  # a symlink out of the cache or an untrustworthy record: refused, not a damaged shard
    except FileNotFoundError as err:
        return [f"file {os.path.relpath(err.filename, shard.path) if err.filename else part} missing"]
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        return [f"unreadable {part}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"]
    return []


def _identity(path: str) -> tuple[int, int, int]:
    info = os.stat(path)
    return info.st_ino, info.st_size, info.st_mtime_ns


def _check_part(shard: Shard, part: str) -> list[str]:
    """Problems of one part of a shard (see ``Shard.checksum_problems``); errors become problems."""
    cache, record = shard.cache, shard.record
    expected = (record.get("checksums") or {}).get(part)
    local = fmt.is_local(cache.fs)
    try:
        key = None
        if local:  # the files' identities, symlinks leaving the cache refused on the way
            files = _local_files(cache, fmt.join(shard.path, fmt.HIDDEN if part == "hidden" else part))
            key = (part, shard.path, xxhash.xxh64_hexdigest(repr(files).encode()), expected)
            with _VERIFIED_LOCK:
                if key in _VERIFIED:
                    return _VERIFIED[key]
        problems = _hash_hidden(shard, expected) if part == "hidden" else _hash_file(shard, part, expected)
    except CacheError:
        raise  # a symlink out of the cache: refused, not a damaged shard
    except FileNotFoundError as err:
        return [f"file {os.path.relpath(err.filename, shard.path) if err.filename else part} missing"]
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        return [f"unreadable {part}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"]
    if key is not None:
        with _VERIFIED_LOCK:
            _VERIFIED[key] = problems
    return problems


def _hash_file(shard: Shard, name: str, expected: str | None) -> list[str]:
    path = fmt.join(shard.path, name)
    fs = shard.cache.fs
    if fmt.is_local(fs):
        with pa.memory_map(path, "r") as f:  # hashed in place, not copied
            digest = xxhash.xxh64(f.read_buffer()).hexdigest()
    else:
        digest = fmt.checksum(fs.cat_file(path))
    return [] if digest == expected else [f"{name} checksum mismatch"]


def _hash_hidden(shard: Shard, expected: str | None) -> list[str]:
    """The stored hidden-state array against the record: shape, dtype, then xxh64 of its bytes in
    C order (what the writer hashed), streamed from the chunk files or, through Zarr, a window at
    a time."""
    cache, record = shard.cache, shard.record
    want_shape = tuple(record.get("hidden_shape") or ())
    want_dtype = fmt.stored_dtype(cache.hidden_dtype, cache.hidden_format)
    digest = xxhash.xxh64()
    files = shard._chunk_files
    if files is not None:
        shape, dtype = files.shape, files.dtype
    else:
        array = shard.hidden_array
        shape, dtype = tuple(array.shape), array.dtype
    if shape != want_shape:
        return [f"hidden shape {shape} differs from {want_shape}"]
    if dtype != want_dtype:
        return [f"hidden dtype {dtype} differs from {want_dtype}, the storage of the manifest's "
                f"{cache.hidden_dtype} ({cache.hidden_format})"]
    rows = shape[0]
    if files is not None:
        for index in range(-(-rows // files.chunk_rows) if rows else 0):
            path = files.chunk_path(index)
            needed = min(files.chunk_rows, rows - index * files.chunk_rows) * files.row_bytes
            data = _mapped(path, *_identity(path))
            if len(data) < needed:
                return [f"file {os.path.relpath(path, shard.path)} is short ({len(data)} of {needed} bytes)"]
            digest.update(data[:needed])
    else:
        step = max(1, HASH_WINDOW // max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize))
        for lo in range(0, rows, step):
            digest.update(np.ascontiguousarray(array[lo:lo + step]).view(np.uint8).reshape(-1))
    return [] if digest.hexdigest() == expected else ["hidden states checksum mismatch"]


def open_cache(url: str, storage_options: dict[str, Any] | None = None) -> Cache:
    """Open the cache at ``url`` (local path, file://, s3://, gs://, ...) for reading."""
    return Cache(url, storage_options)
