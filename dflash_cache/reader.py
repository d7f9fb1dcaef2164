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
``Cache.ensure_intact`` is the one check by which training and evaluation refuse damaged shards;
the checks themselves are dflash_cache.integrity's, and the file access dflash_cache.shard_files'.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence as SequenceABC
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Collection, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import xxhash
import zarr

from dflash_cache import format as fmt
from dflash_cache import health
from dflash_cache import index as cache_index
from dflash_cache.hidden_files import HiddenChecksumError, ShardedHidden
from dflash_cache.integrity import (
    RECORD,
    SIZES,
    ShardIntegrityError,
    damaged_shards_message,
    inside_cache,
    part_problems,
    quick_check,
    read_parts,
    record_problems,
)
from dflash_cache.shard_files import ChunkFiles, fixed_list_values, open_ipc
from dflash_cache.store import CacheStore
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


class Shard:
    """A committed shard: its sequence table, token table and hidden-state array. Format 1: from
    its commit record in the manifest and its own sequences.arrow; format 2: from the row
    ``position`` of the index's shard table and its rows of the sequence table (no file of the
    shard is read until its tokens or hidden states are)."""

    def __init__(self, cache: "Cache", record: dict | None = None, position: int | None = None):
        self.cache, self.position = cache, position
        if record is not None:
            self.record = record
        self.name = record["name"] if record is not None else cache._table.column("name")[position]
        self.version = cache.version
        self.path = fmt.shard_path(cache.root, self.name, self.version)
        self._checked: dict[str, list[str]] = {}  # part -> its problems, once checked
        self._check_lock = threading.Lock()
        if self.version != 1 and fmt.is_local(cache.fs):  # format 2 checks its links here, not at open
            real_root = os.path.realpath(cache.root)
            for path in (self.path, f"{self.path}.json", os.path.dirname(self.path)):
                if os.path.islink(path):
                    inside_cache(real_root, path, cache.url)

    @cached_property
    def record(self) -> dict:
        """The commit record (format 2: the shard table's row, in the same form)."""
        return self.cache._table.record(self.position)

    @cached_property
    def _sequence_rows(self) -> tuple[int, int]:
        first = self.cache._first_sequence
        return int(first[self.position]), int(first[self.position + 1])

    def checksum_problems(self, parts: Sequence[str] | None = None) -> list[str]:
        """What differs between this shard's files and the checksums of its commit record (empty
        when intact): ``parts`` of sequences.arrow, tokens.arrow and "hidden" (the hidden-state
        array as stored, its shape and dtype included); default: those a read uses
        (``integrity.read_parts``). Each part is hashed once per shard object
        and, on local storage, once per process while its files stay the same (a file replaced or
        rewritten since is hashed again). Thread-safe; files are streamed, never loaded whole."""
        problems = []
        for part in read_parts(self.version) if parts is None else parts:
            with self._check_lock:
                if part not in self._checked:
                    # a manifest edited to other counts keeps every checksum: its records are
                    # checked as `verify` checks them (the commit record first, the counts once
                    # the bytes are known to be the ones written)
                    self._checked[part] = ((record_problems(self, RECORD) if part == fmt.SEQUENCES else [])
                                           or part_problems(self, part) or record_problems(self, part))
                problems += self._checked[part]
        return problems

    def ensure_intact(self, parts: Sequence[str] | None = None) -> None:
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
            "topk_ids": fixed_list_values(table, "topk_ids", k, "top_k", where),
            "topk_logprobs": fixed_list_values(table, "topk_logprobs", k, "top_k", where),
        }
        if self.cache.hidden_format != fmt.LOSSLESS:  # fp8: the hidden states' scale exponents
            tokens[fmt.SCALE_COLUMN] = fixed_list_values(table, fmt.SCALE_COLUMN, len(self.cache.layer_ids),
                                                          "layer_ids", where)
        return tokens

    @cached_property
    def hidden_array(self) -> zarr.Array:
        return zarr.open_array(self.cache.store.zarr_store(fmt.join(self.path, fmt.HIDDEN), read_only=True), mode="r")

    def _indexed(self, column: str):
        lo, hi = self._sequence_rows
        return self.cache._sequence_table.column(column).slice(lo, hi - lo)

    @cached_property
    def ids(self) -> list[str]:
        if self.version != 1:
            return self._indexed("id").to_pylist()
        return self._sequences.column("id").to_pylist()

    @cached_property
    def offsets(self) -> np.ndarray:
        if self.version != 1:
            return self._indexed("offset").to_numpy()
        return self._sequences.column("offset").to_numpy()

    @cached_property
    def lengths(self) -> np.ndarray:
        if self.version != 1:
            return self._indexed("length").to_numpy()
        return self._sequences.column("length").to_numpy()

    def __len__(self) -> int:
        if self.version != 1:
            lo, hi = self._sequence_rows
            return hi - lo
        return int(self.record["sequences"])

    @cached_property
    def _chunk_files(self) -> "ChunkFiles | ShardedHidden | None":
        """The fast local reader of the hidden states (format 1: chunk files; format 2: the shard
        object), or None: Zarr reads them."""
        if not fmt.is_local(self.cache.fs):
            return None
        opener = ChunkFiles.open if self.version == 1 else ShardedHidden.open
        return opener(fmt.join(self.path, fmt.HIDDEN))

    def read_stored(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Token rows start..stop of the hidden-state array exactly as stored (e.g. uint16 for bf16).
        Uncompressed local shards are read straight from their chunk files (format 1) or shard
        object (format 2, each inner chunk's crc32c checked as it is first read); anything else
        goes through Zarr (whose codec checks format 2's crc32c). Bytes that fail their crc32c are
        ShardIntegrityError, the one refusal of a damaged shard."""
        try:
            if self._chunk_files is not None:
                return self._chunk_files.read(start, stop, out)
            stored = self.hidden_array[start:stop]
        except HiddenChecksumError as err:
            raise ShardIntegrityError(self.cache.url, self.name, [f"hidden states: {err.problem}"]) from None
        except ValueError as err:
            if self.version == 1 or "checksum" not in str(err):
                raise
            raise ShardIntegrityError(self.cache.url, self.name, ["hidden states: a chunk's crc32c mismatch"]) from None
        if out is not None:
            out.view(stored.dtype)[...] = stored
            return out
        return stored

    def read_hidden(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Hidden states of token rows start..stop of this shard, in their true dtype (fp8 shards
        decoded with their scales). With ``out`` (that shape and dtype) they are written there:
        uncompressed lossless local shards read straight into it, with no copy in between."""
        cache = self.cache
        if out is not None and cache.hidden_format == fmt.LOSSLESS and self._chunk_files is not None:
            self.read_stored(start, stop, out)
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
        self.store = CacheStore.open(url, storage_options)
        self.url, self.fs, self.root = url, self.store.fs, self.store.root
        self.manifest = fmt.read_manifest(self.fs, self.root, url)
        self.version: int = int(self.manifest["format_version"])
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.hidden_dtype: str = self.manifest["hidden_dtype"]
        self.hidden_format: str = fmt.hidden_format_of(self.manifest)
        self.top_k: int = int(self.manifest["top_k"])
        if self.version != 1:
            # two reads whatever the shard count; the shards' own files wait until they are read
            with fmt.reaching(url):
                self._table, self._sequence_table = cache_index.open_index(self.store, self.manifest)
            counts = self._table.numpy("sequences") if len(self._table) else np.zeros(0, np.int64)
            self._first_sequence = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            self.shards: Sequence[Shard] = ShardList(self)
            if fmt.is_local(self.fs):
                inside_cache(os.path.realpath(self.root), os.path.join(self.root, fmt.SHARDS_DIR), self.url)
            return
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
        """Format 1 on local storage: refuse a shards folder, shard folder or commit record that
        is a symlink resolving outside the cache (one lstat a shard; the files inside a shard are
        checked where they are read: ``refuse_outside_links``)."""
        root = os.path.realpath(self.root)
        shards_dir = os.path.join(self.root, fmt.SHARDS_DIR)
        inside_cache(root, shards_dir, self.url)
        for shard in self.shards:
            for path in (os.path.join(shards_dir, shard.name), os.path.join(shards_dir, f"{shard.name}.json")):
                if os.path.islink(path):
                    inside_cache(root, path, self.url)

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @cached_property
    def fingerprint(self) -> str:
        """The cache's identity: teacher, tokenizer, layers, k, dtype and the committed shards'
        checksums. A checkpoint records it, so a run resumes only on the cache it trained on."""
        keys = ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype")
        if self.version != 1:
            c = self._table.column
            shards = [(name, {"hidden": h, fmt.TOKENS: t, fmt.SEQUENCES: q}) for name, h, t, q in
                      zip(c("name"), c("checksum_hidden"), c("checksum_tokens"), c("checksum_sequences"))]
        else:
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
        if self.version != 1:
            return self._sequence_table.num_rows
        return sum(len(s) for s in self.shards)

    def capture_health(self) -> tuple[list[dict], list[str]]:
        """Per tapped layer over the cache (RMS, share of zeros, NaN/Inf) and the flags of
        dflash_cache.health, from the capture health the writer recorded (shards written before it
        was recorded are left out; none: nothing to report)."""
        n_layers = len(self.layer_ids)
        if self.version != 1:
            table = self._table
            rms, zeros, nonfinite = (table.matrix(k, n_layers) for k in ("rms", "zero_fraction", "nonfinite"))
            tokens, names = table.numpy("tokens") if len(table) else np.zeros(0), table.column("name")
        else:
            got = [(s.record.get("health") or {}, s.record["tokens"], s.name) for s in self.shards]
            rows = [(h, t, n) for h, t, n in got if len(h.get("rms", [])) == n_layers]
            rms, zeros, nonfinite = (np.array([h[k] for h, _, _ in rows]).reshape(-1, n_layers)
                                     for k in ("rms", "zero_fraction", "nonfinite"))
            tokens, names = np.array([t for _, t, _ in rows]), [n for _, _, n in rows]
        known = ~np.isnan(rms).any(axis=1)
        if not known.any():
            return [], []
        return health.summary(rms[known], zeros[known], nonfinite[known], np.asarray(tokens)[known], self.layer_ids,
                              [n for n, k in zip(names, known) if k])

    @property
    def totals(self) -> dict:
        """Sequences, tokens, loss tokens, bytes, shards and skipped rows, summed from the index (not
        the manifest's ``totals``, which an edited or hand-made manifest may lack)."""
        if self.version != 1:
            return self._table.totals()
        return fmt.totals([s.record for s in self.shards])

    @property
    def num_tokens(self) -> int:
        if self.version != 1:
            return int(self._table.numpy("tokens").sum()) if len(self._table) else 0
        return sum(int(s.record["tokens"]) for s in self.shards)

    def sequence_table(self, skip: Collection[str] = ()) -> pa.Table:
        """Every sequence of the cache at once, in shard order, as Arrow columns: ``shard`` (int32,
        its shard's index in ``shards``), ``offset`` (int64, first token row in the shard),
        ``length`` (int32), ``id`` (string), ``row`` (int64, corpus row); the rows of the shards
        named in ``skip`` left out (their files are not read). The cheap way to plan over a whole
        cache: format 2 holds it in the index (read at open, no shard file opened); format 1 reads
        every other shard's sequences.arrow, each checked against its checksum first (CacheError
        naming the damaged ones). ``.column("length").to_numpy()`` etc. give numpy arrays without
        a copy."""
        columns, skip = ["shard", "offset", "length", "id", "row"], set(skip)
        if self.version != 1:
            table = self._sequence_table.select(columns)
            if not skip:
                return table
            names = self.shard_names()
            skipped = np.array([j for j, name in enumerate(names) if name in skip], dtype=np.int32)
            return table.filter(pa.array(~np.isin(table.column("shard").to_numpy(), skipped)))
        self.ensure_intact((fmt.SEQUENCES,), skip=skip)
        tables = [cache_index.sequence_rows(shard._sequences, position).select(columns)
                  for position, shard in enumerate(self.shards) if shard.name not in skip]
        if not tables:
            return cache_index.sequence_schema().empty_table().select(columns)
        return pa.concat_tables(tables)

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

    def checksum_problems(self, shards: Iterable[int], parts: Sequence[str] | None = None,
                          threads: int = 4) -> dict[str, list[str]]:
        """``Shard.checksum_problems`` of the shards at these indices, several hashed at once:
        shard name -> problems, for the damaged ones only. Default parts: those a read uses."""
        parts = read_parts(self.version) if parts is None else parts
        shards = [self.shards[i] for i in dict.fromkeys(shards)]
        if sum(not s._checked.keys() >= set(parts) for s in shards) > 1 and threads > 1:
            with ThreadPoolExecutor(min(threads, len(shards)), thread_name_prefix="dflash-checksum") as pool:
                found = list(pool.map(lambda s: s.checksum_problems(parts), shards))
        else:
            found = [s.checksum_problems(parts) for s in shards]
        return {s.name: p for s, p in zip(shards, found) if p}

    def ensure_intact(self, parts: Sequence[str] | None = None, shards: Iterable[int] | None = None,
                      skip: Collection[str] = (), threads: int = 4) -> int:
        """The one integrity check by which training and evaluation refuse damaged shards: refuses
        ``skip`` names (--skip-shards) the cache does not list (ConfigError), then every shard at
        the indices ``shards`` (default: each one not skipped) whose ``parts`` fail, in one line
        naming each with its first problem and both ways out (CacheError). Parts: SIZES (one
        listing of shards/: missing folders and files, sizes other than the commit records';
        cheap enough for every start) and the checksummed ones (``Shard.checksum_problems``, each
        shard hashed once per process); default: the checksummed parts a read uses
        (``integrity.read_parts``). Returns the number of sequences the skipped shards hold."""
        parts = read_parts(self.version) if parts is None else parts
        names_all = self.shard_names()
        listed = ({name: int(n) for name, n in zip(names_all, np.diff(self._first_sequence))} if self.version != 1
                  else {s.name: len(s) for s in self.shards}) if skip else {}  # per batch in the loader: no walk without skips
        unknown = [name for name in skip if name not in listed]
        if unknown:
            raise ConfigError(f"--skip-shards names {unknown}, which {self.url} does not list; take names from "
                              "`dflash-cache verify` or `dflash-cache info --json`")
        chosen = [i for i, name in enumerate(names_all) if name not in skip] if shards is None else list(shards)
        problems = {}
        if SIZES in parts:
            names = {names_all[i] for i in chosen}
            problems = {name: bad for name, bad in quick_check(self, set(skip)).items() if name in names}
        checksummed = [part for part in parts if part != SIZES]
        if checksummed:
            problems.update(self.checksum_problems([i for i in chosen if names_all[i] not in problems],
                                                   checksummed, threads))
        if problems:
            raise CacheError(damaged_shards_message(self.url, problems))
        return sum(listed[name] for name in set(skip))

    def shard_names(self) -> list[str]:
        """The shards' names, in order (format 2: from the index, no Shard made)."""
        if self.version != 1:
            return self._table.column("name")
        return [s.name for s in self.shards]

    def sequence_bytes(self, shard: int, i: int) -> int:
        """Bytes of one sequence's hidden states as the reader hands them out."""
        return int(self.shards[shard].lengths[i]) * self.hidden_bytes_per_token

    @cached_property
    def _index(self) -> dict[str, tuple[int, int]]:
        if self.version != 1:
            position = self._sequence_table.column("shard").to_numpy()
            within = np.arange(len(position)) - self._first_sequence[position]
            return dict(zip(self._sequence_table.column("id").to_pylist(), zip(position.tolist(), within.tolist())))
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


class ShardList(SequenceABC):
    """A format-2 cache's shards, made on first use (an index of 100k shards opens without 100k
    objects). The ``OPEN_SHARDS`` used last are kept (``cache.shards[j]`` is then the same Shard
    each time); older ones are dropped with their file maps, since a process holding one map per
    shard of a 100k-shard epoch would pass the kernel's 65,530 maps and fail every read after."""

    OPEN_SHARDS = 1024

    def __init__(self, cache: Cache):
        self._cache = cache
        self._made: OrderedDict[int, Shard] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache._table)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        n = len(self)
        if not -n <= j < n:
            raise IndexError(f"shard index {j} out of range ({n} shards)")
        j %= n
        with self._lock:
            shard = self._made.get(j)
            if shard is None:
                shard = self._made[j] = Shard(self._cache, position=j)
                if len(self._made) > self.OPEN_SHARDS:
                    self._made.popitem(last=False)
            else:
                self._made.move_to_end(j)
        return shard


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


def open_cache(url: str, storage_options: dict[str, Any] | None = None) -> Cache:
    """Open the cache at ``url`` (local path, file://, s3://, gs://, ...) for reading."""
    return Cache(url, storage_options)
