"""A committed shard of an opened cache (``Shard``) and one sequence read from it (``SequenceRecord``).

Per-token arrays are zero-copy views of memory-mapped Arrow files on local storage. Hidden states
of uncompressed local shards are read straight from their files (format 1: chunk files; format 2:
the shard object, each inner chunk's crc32c checked as it is first read); compressed or remote
ones go through Zarr. ``Shard.checksum_problems`` compares a shard's bytes with the checksums of
its commit record, hashing each part once per process (the training loader calls it before it
hands out anything of a shard); the checks are dflash_cache.format.integrity's.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from dflash_cache import format as fmt
from dflash_cache.format.cache_layout import inside_cache
from dflash_cache.format.hidden import HiddenChecksumError
from dflash_cache.format.integrity import RECORD, ShardIntegrityError, layout_problems, part_problems, record_problems
from dflash_cache.format.record import ShardFiles
from dflash_cache.format.token_tables import decode_tokens


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
    """Shard ``position`` of an opened cache: its commit record (format 2: the index's row of it),
    its sequences (format 1: from its own sequences.arrow; format 2: from the index), token table
    and hidden states. No file of the shard is read until its tokens or hidden states are."""

    def __init__(self, cache, position: int):
        self.cache, self.position = cache, position
        listing = cache.listing
        self.name = listing.names[position]
        self.files = ShardFiles(cache.store, cache.spec, cache.layout, self.name, lambda: listing.record(position))
        self.path = self.files.path
        self._checked: dict[str, list[str]] = {}  # part -> its problems, once checked
        self._check_lock = threading.Lock()
        if cache.store.local:  # a shard's folder, record or rank folder linked out of the cache is refused
            real_root = os.path.realpath(cache.root)
            for path in (self.path, f"{self.path}.json", os.path.dirname(self.path)):
                if os.path.islink(path):
                    inside_cache(real_root, path, cache.url)

    @property
    def record(self) -> dict:
        """The commit record (format 2: the shard table's row, in the same form)."""
        return self.files.record

    def checksum_problems(self, parts: Sequence[str] | None = None) -> list[str]:
        """What differs between this shard's files and the checksums of its commit record (empty
        when intact): ``parts`` of sequences.arrow, tokens.arrow and "hidden" (the hidden-state
        array as stored, its shape and dtype included); default: those a read uses (the layout's
        ``read_parts``). Each part is hashed once per shard object and, on local storage, once per
        process while its files stay the same (a file replaced or rewritten since is hashed again).
        Thread-safe; files are streamed, never loaded whole."""
        problems = []
        for part in self.cache.layout.read_parts if parts is None else parts:
            with self._check_lock:
                if part not in self._checked:
                    # a manifest edited to other counts keeps every checksum: its records are
                    # checked as `verify` checks them (the commit record first, the counts once
                    # the bytes are known to be the ones written)
                    self._checked[part] = ((record_problems(self.files, RECORD) if part == fmt.SEQUENCES else [])
                                           or part_problems(self.files, part) or record_problems(self.files, part))
                problems += self._checked[part]
        return problems

    def ensure_layout(self) -> None:
        """Raise ShardIntegrityError unless the hidden-state array holds the rows its record and the
        index promise (``integrity.layout_problems``): what a loader checks before it sizes a buffer
        from the index's lengths. Once per shard object."""
        with self._check_lock:
            if "layout" not in self._checked:
                self._checked["layout"] = layout_problems(self.files)
        if self._checked["layout"]:
            raise ShardIntegrityError(self.cache.url, self.name, self._checked["layout"])

    def ensure_intact(self, parts: Sequence[str] | None = None) -> None:
        """Raise ShardIntegrityError when ``checksum_problems(parts)`` finds any."""
        problems = self.checksum_problems(parts)
        if problems:
            raise ShardIntegrityError(self.cache.url, self.name, problems)

    @cached_property
    def _sequences(self) -> pa.Table:
        return self.cache.listing.shard_sequences(self.position)

    @cached_property
    def _tokens(self) -> dict[str, np.ndarray]:
        table = self.cache.store.open_ipc(fmt.join(self.path, fmt.TOKENS))
        spec = self.cache.spec
        return decode_tokens(table, spec.top_k, spec.scale_layers, f"{self.cache.url}: shard {self.name}")

    @property
    def hidden_array(self):
        return self.files.hidden_array

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
        first = self.cache.listing.first_sequence
        return int(first[self.position + 1] - first[self.position])

    def read_stored(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Token rows start..stop of the hidden-state array exactly as stored (e.g. uint16 for bf16).
        Uncompressed local shards are read straight from their chunk files (format 1) or shard
        object (format 2, each inner chunk's crc32c checked as it is first read); anything else
        goes through Zarr (whose codec checks format 2's crc32c). Bytes that fail their crc32c are
        ShardIntegrityError, the one refusal of a damaged shard."""
        fast = self.files.fast_hidden
        try:
            if fast is not None:
                return fast.read(start, stop, out)
            stored = self.files.hidden_array[start:stop]
        except HiddenChecksumError as err:
            raise ShardIntegrityError(self.cache.url, self.name, [f"hidden states: {err.problem}"]) from None
        except ValueError as err:
            if "checksum" not in str(err):
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
        spec = self.cache.spec
        if out is not None and not spec.scale_layers and self.files.fast_hidden is not None:
            self.read_stored(start, stop, out)
            return out
        scales = self._tokens[fmt.SCALE_COLUMN][start:stop] if spec.scale_layers else None
        hidden = fmt.decode_hidden(self.read_stored(start, stop), scales, spec.hidden_dtype, spec.hidden_format)
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

    def records(self, window_bytes: int = 64 * 2**20, spares: list[np.ndarray] | None = None) -> Iterator[SequenceRecord]:
        """All sequences in order, reading hidden states in large windows rather than per sequence.
        Each window is read into a buffer of ``spares`` that no record or tensor views any more
        (``idle_buffer``), so a caller that lets go of its records reads into memory it already
        faulted in instead of fresh pages; ``Cache.sequences`` passes one list for every shard."""
        n = len(self)
        if n == 0:
            return
        spares = [] if spares is None else spares
        window_tokens = max(1, window_bytes // max(1, self.cache.hidden_bytes_per_token))
        offsets, lengths = self.offsets, self.lengths
        i = 0
        while i < n:
            start = int(offsets[i])
            j = i + 1
            while j < n and int(offsets[j] + lengths[j]) - start <= window_tokens:
                j += 1
            stop = int(offsets[j - 1] + lengths[j - 1])
            window = self.read_hidden(start, stop, self._window_out(spares, stop - start, window_bytes))
            for s in range(i, j):
                lo = int(offsets[s]) - start
                yield self._record(s, window[lo:lo + int(lengths[s])])
            del window  # the records alone keep its buffer busy
            i = j

    def _window_out(self, spares: list[np.ndarray], tokens: int, window_bytes: int) -> np.ndarray:
        """Where ``tokens`` rows of hidden states are read: the front of an idle buffer of ``spares``."""
        cache = self.cache
        per_token = cache.hidden_bytes_per_token
        buffer = idle_buffer(spares, max(tokens * per_token, window_bytes))
        dtype = fmt.HIDDEN_NUMPY[cache.hidden_dtype]
        return buffer[:tokens * per_token].view(dtype).reshape(tokens, len(cache.layer_ids), cache.hidden_size)


SPARE_BUFFERS = 3
"""Read buffers a sequential read keeps for reuse: the window being handed out, the one before it
(records a caller still holds while it takes the next) and one more."""


def idle_buffer(spares: list[np.ndarray], nbytes: int) -> np.ndarray:
    """A uint8 buffer of at least ``nbytes`` from ``spares`` that nothing else references any more
    (no record, array view or tensor made from it: CPython's reference count shows only the list's),
    else a new one put in ``spares`` in place of the oldest beyond SPARE_BUFFERS (a buffer still
    in use stays alive for its users, only the list lets go of it). Reusing a buffer skips the
    page faults of fresh memory, which on a VM cost about as much as the copy itself."""
    for k in range(len(spares)):
        if spares[k].nbytes >= nbytes and sys.getrefcount(spares[k]) == 2:  # the list's and the argument's
            return spares[k]
    buffer = np.empty(nbytes, np.uint8)
    spares.append(buffer)
    if len(spares) > SPARE_BUFFERS:
        del spares[0]
    return buffer
