"""The public way to read a cache: ``open_cache(url)`` gives a ``Cache``.

Only shards listed in the manifest (format 1) or the index (format 2) are visible, and a shard is
listed only after its commit record exists, so a half-written shard can never be read. What
differs between format versions is asked of the version's layout (dflash_cache.format.versions);
a shard and its sequences are dflash_cache.shard's, the read-ahead dflash_cache.read_ahead's.

Nothing read from a manifest or an index is trusted as a path: every shard name is checked when
the cache is opened, and on local storage a shard folder or file that is a symlink resolving
outside the cache is refused. ``Cache.ensure_intact`` is the one check by which training and
evaluation refuse damaged shards.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any, Collection, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from dflash_cache import format as fmt
from dflash_cache import health
from dflash_cache.format.integrity import SIZES, damaged_shards_message
from dflash_cache.format.manifest import ArraySpec
from dflash_cache.format.store import CacheStore, reaching
from dflash_cache.format.teacher_folder import check_teacher_files
from dflash_cache.read_ahead import ReadAhead
from dflash_cache.shard import SequenceRecord, Shard
from dflash_common.errors import CacheError, ConfigError, quoted
from dflash_common.settings_files import load_settings_file
from dflash_common.template_kwargs import check_template_kwargs

__all__ = ["Cache", "SequenceRecord", "Shard", "open_cache"]


class Cache:
    """A dflash cache opened for reading. Build one with ``open_cache``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.store = CacheStore.open(url, storage_options)
        self.url, self.fs, self.root = url, self.store.fs, self.store.root
        self.manifest = fmt.read_manifest(self.store)
        self.version: int = int(self.manifest["format_version"])
        self.layout = fmt.layout_for(self.version)
        self.spec = ArraySpec.of(self.manifest)
        self.layer_ids: list[int] = list(self.spec.layer_ids)
        self.hidden_size: int = self.spec.hidden_size
        self.hidden_dtype: str = self.spec.hidden_dtype
        self.hidden_format: str = self.spec.hidden_format
        self.top_k: int = self.spec.top_k
        with reaching(url):
            self.listing = self.layout.listing(self.store, self.manifest)
        self.shards: Sequence[Shard] = ShardList(self)
        self._teacher_checked = False

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @cached_property
    def fingerprint(self) -> str:
        """The cache's identity: teacher, tokenizer, layers, k, dtype and the committed shards'
        checksums. A checkpoint records it, so a run resumes only on the cache it trained on."""
        keys = ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype")
        payload = json.dumps([{k: self.manifest.get(k) for k in keys}, self.listing.checksums()], sort_keys=True)
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
        return int(self.listing.first_sequence[-1])

    def capture_health(self) -> tuple[list[dict], list[str]]:
        """Per tapped layer over the cache (RMS, share of zeros, NaN/Inf) and the flags of
        dflash_cache.health, from the capture health the writer recorded (shards written before it
        was recorded are left out; none: nothing to report)."""
        rms, zeros, nonfinite, tokens, names = self.listing.health(len(self.layer_ids))
        known = ~np.isnan(rms).any(axis=1)
        if not known.any():
            return [], []
        return health.summary(rms[known], zeros[known], nonfinite[known], np.asarray(tokens)[known], self.layer_ids,
                              [n for n, k in zip(names, known) if k])

    @property
    def totals(self) -> dict:
        """Sequences, tokens, loss tokens, bytes, shards and skipped rows, summed from the index (not
        the manifest's ``totals``, which an edited or hand-made manifest may lack)."""
        return self.listing.totals()

    @property
    def num_tokens(self) -> int:
        return int(self.totals["tokens"])

    def sequence_table(self, skip: Collection[str] = ()) -> pa.Table:
        """Every sequence of the cache at once, in shard order, as Arrow columns: ``shard`` (int32,
        its shard's index in ``shards``), ``offset`` (int64, first token row in the shard),
        ``length`` (int32), ``id`` (string), ``row`` (int64, corpus row); the rows of the shards
        named in ``skip`` left out (their files are not read). The cheap way to plan over a whole
        cache: format 2 holds it in the index (read at open, no shard file opened); format 1 reads
        every other shard's sequences.arrow, each checked against its checksum first (CacheError
        naming the damaged ones). ``.column("length").to_numpy()`` etc. give numpy arrays without
        a copy."""
        skip = set(skip)
        if self.layout.plan_parts:
            self.ensure_intact(self.layout.plan_parts, skip=skip)
        keep = [j for j, name in enumerate(self.shard_names()) if name not in skip]
        return self.listing.sequence_table(keep).select(["shard", "offset", "length", "id", "row"])

    def sequences(self) -> Iterator[SequenceRecord]:
        """Every sequence, shard by shard, in order (``Shard.records``; one set of read buffers
        reused across shards)."""
        spares: list[np.ndarray] = []
        for shard in self.shards:
            yield from shard.records(spares=spares)

    def read_ahead(self, refs: Iterable[tuple], max_bytes: int = 256 * 2**20, threads: int = 4,
                   check: bool = False) -> ReadAhead:
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
        parts = self.layout.read_parts if parts is None else parts
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
        listing of shards/ on format 1: missing folders and files, sizes other than the commit
        records'; cheap enough for every start) and the checksummed ones
        (``Shard.checksum_problems``, each shard hashed once per process); default: the
        checksummed parts a read uses (the layout's ``read_parts``). Returns the number of
        sequences the skipped shards hold."""
        parts = self.layout.read_parts if parts is None else parts
        names_all = self.shard_names()
        # per batch in the loader: no walk without skips
        listed = {name: int(n) for name, n in zip(names_all, np.diff(self.listing.first_sequence))} if skip else {}
        unknown = [name for name in skip if name not in listed]
        if unknown:
            raise ConfigError(f"--skip-shards names {unknown}, which {self.url} does not list; take names from "
                              "`dflash-cache verify` or `dflash-cache info --json`")
        chosen = [i for i, name in enumerate(names_all) if name not in skip] if shards is None else list(shards)
        problems = {}
        if SIZES in parts:
            names = {names_all[i] for i in chosen}
            problems = {name: bad for name, bad in self.listing.size_problems(set(skip)).items() if name in names}
        checksummed = [part for part in parts if part != SIZES]
        if checksummed:
            problems.update(self.checksum_problems([i for i in chosen if names_all[i] not in problems],
                                                   checksummed, threads))
        if problems:
            raise CacheError(damaged_shards_message(self.url, problems))
        return sum(listed[name] for name in set(skip))

    def shard_names(self) -> list[str]:
        """The shards' names, in order (no Shard made)."""
        return self.listing.names

    def sequence_bytes(self, shard: int, i: int) -> int:
        """Bytes of one sequence's hidden states as the reader hands them out."""
        return int(self.shards[shard].lengths[i]) * self.hidden_bytes_per_token

    @cached_property
    def _index(self) -> dict[str, tuple[int, int]]:
        table = self.sequence_table()
        position = table.column("shard").to_numpy()
        within = np.arange(len(position)) - self.listing.first_sequence[position]
        return dict(zip(table.column("id").to_pylist(), zip(position.tolist(), within.tolist())))

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
        """The path of ``name`` in the teacher folder, checked to be a regular file inside the cache
        (``name`` empty: the folder, whose files ``load_tokenizer`` checks)."""
        path = fmt.join(self.root, fmt.TEACHER_DIR, name)
        return self.store.regular(path) if name else path

    @property
    def chat_template_kwargs(self) -> dict | None:
        """The chat-template variables the corpus was rendered with at build (None: the template's
        defaults), checked as a build checks them: eval and generate render prompts with them, so an
        edited manifest must not hand the template a template of its own or a kwargs list."""
        options = self.manifest.get("content_options")
        if options is not None and not isinstance(options, dict):
            raise CacheError(f"{self.url}: manifest.json's content_options is {quoted(options, 40)}, not an object; "
                             "rebuild the cache, or restore its manifest")
        kwargs = (options or {}).get("chat_template_kwargs")
        check_template_kwargs(kwargs, f"{self.url}: manifest.json's content_options.chat_template_kwargs",
                              CacheError, "rebuild the cache, or restore its manifest")
        return kwargs

    def check_teacher_files(self) -> None:
        """Refuse a teacher/ folder whose files are not bounded regular files inside the cache
        (dflash_cache.format.teacher_folder), once per Cache: before the tokenizer or the config
        is read, since transformers reads them whole and parses their JSON recursively."""
        if not self._teacher_checked:
            check_teacher_files(self.store)
            self._teacher_checked = True

    def teacher_config(self) -> dict:
        self.check_teacher_files()
        what = f"{self.url}: {fmt.TEACHER_DIR}/config.json"
        values = load_settings_file(self.teacher_path("config.json"), what, "json", error=CacheError,
                                    fix="rebuild the cache", fs=self.fs)
        if not isinstance(values, dict):
            raise CacheError(f"{what} holds a JSON {type(values).__name__}, not a model config; rebuild the cache")
        return values

    def teacher_head_bytes(self) -> bytes:
        """teacher/head.safetensors's bytes, checked without torch: against the checksum the
        manifest records (when it records one), and each tensor for a floating dtype and for
        NaN/Inf. A drafter trains on this head frozen, so a damaged one would train silently into
        a useless drafter; any problem is one CacheError line."""
        path = self.teacher_path(fmt.TEACHER_HEAD)
        where = f"{self.url}: {fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD}"
        fix = "rebuild the cache with `dflash-cache build ... --overwrite` (or restore the file)"
        if not self.fs.exists(path):
            raise CacheError(f"{where} (the teacher head) is missing; {fix}")
        record, size = self.manifest.get("teacher_head"), self.fs.size(path)
        if isinstance(record, dict) and size != record.get("bytes"):  # refused before it is read whole
            raise CacheError(f"{where} is {size:,} bytes, the manifest records {record.get('bytes')!r}; {fix}")
        data = self.fs.cat_file(path)
        problem = fmt.teacher_head_problem(data, self.manifest.get("teacher_head")) or fmt.head_tensor_problem(data)
        if problem:
            raise CacheError(f"{where} {problem}; {fix}")
        return data

    def load_teacher_head(self, device: str = "cpu") -> dict:
        """{'embed_tokens.weight': [V, H], 'lm_head.weight': [V, H]} as torch tensors, checked
        (``teacher_head_bytes``)."""
        import safetensors.torch
        from safetensors import SafetensorError

        data = self.teacher_head_bytes()
        try:
            tensors = safetensors.torch.load(data)
        except (SafetensorError, ValueError, RuntimeError) as err:
            raise CacheError(f"{self.url}: {fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD} is not a readable safetensors file "
                             f"({str(err)[:120]}); rebuild the cache with `dflash-cache build ... --overwrite`") from None
        return {k: v.to(device) for k, v in tensors.items()}

    def load_tokenizer(self):
        """The teacher's tokenizer as saved in the cache."""
        import tempfile

        from transformers import AutoTokenizer

        # a cache may come from anyone: its tokenizer folder never runs code, and each of its files
        # is a bounded regular file inside the cache (no link out, no FIFO, no 3 GiB file)
        self.check_teacher_files()
        if fmt.is_local(self.fs):
            return AutoTokenizer.from_pretrained(self.teacher_path(""), trust_remote_code=False)
        with tempfile.TemporaryDirectory() as tmp:
            self.fs.get(self.teacher_path("") + "/", tmp + "/", recursive=True)
            return AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)


class ShardList(SequenceABC):
    """A cache's shards, made on first use (an index of 100k shards opens without 100k objects).
    The ``OPEN_SHARDS`` used last are kept (``cache.shards[j]`` is then the same Shard each time);
    older ones are dropped with their file maps, since a process holding one map per shard of a
    100k-shard epoch would pass the kernel's 65,530 maps and fail every read after."""

    OPEN_SHARDS = 1024

    def __init__(self, cache: Cache):
        self._cache = cache
        self._made: OrderedDict[int, Shard] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache.listing.names)

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
                shard = self._made[j] = Shard(self._cache, j)
                if len(self._made) > self.OPEN_SHARDS:
                    self._made.popitem(last=False)
            else:
                self._made.move_to_end(j)
        return shard


def open_cache(url: str, storage_options: dict[str, Any] | None = None) -> Cache:
    """Open the cache at ``url`` (local path, file://, s3://, gs://, ...) for reading."""
    return Cache(url, storage_options)
