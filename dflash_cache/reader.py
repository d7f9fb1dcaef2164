"""The public way to read a cache: ``open_cache(url)``.

Only shards listed in the manifest are visible, and a shard is listed only after its commit
record exists, so a half-written shard can never be read. Per-token arrays are zero-copy views of
memory-mapped Arrow files on local storage; hidden states are read from Zarr in chunk-sized
windows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import zarr

from dflash_cache import format as fmt
from dflash_cache.errors import CacheError
from dflash_cache.writer import zarr_store


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


def _open_ipc(fs, path: str) -> pa.Table:
    if fmt.is_local(fs):
        return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
    return pa.ipc.open_file(pa.BufferReader(fs.cat_file(path))).read_all()


def _fixed_list_values(column: pa.ChunkedArray, k: int) -> np.ndarray:
    return column.combine_chunks().values.to_numpy(zero_copy_only=True).reshape(-1, k)


class Shard:
    """A committed shard: its sequence table, token table and hidden-state array."""

    def __init__(self, cache: "Cache", record: dict):
        self.cache, self.record, self.name = cache, record, record["name"]
        self.path = fmt.join(cache.root, fmt.SHARDS_DIR, self.name)

    @cached_property
    def _sequences(self) -> pa.Table:
        return _open_ipc(self.cache.fs, fmt.join(self.path, fmt.SEQUENCES))

    @cached_property
    def _tokens(self) -> dict[str, np.ndarray]:
        table = _open_ipc(self.cache.fs, fmt.join(self.path, fmt.TOKENS))
        k = self.cache.top_k
        return {
            "input_ids": table.column("input_ids").combine_chunks().to_numpy(zero_copy_only=True),
            "loss_mask": table.column("loss_mask").combine_chunks().to_numpy(zero_copy_only=True),
            "topk_ids": _fixed_list_values(table.column("topk_ids"), k),
            "topk_logprobs": _fixed_list_values(table.column("topk_logprobs"), k),
        }

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

    def read_hidden(self, start: int, stop: int) -> np.ndarray:
        """Hidden states of token rows start..stop of this shard, in their true dtype."""
        return fmt.from_storage(self.hidden_array[start:stop], self.cache.hidden_dtype)

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
        start, length = int(self.offsets[i]), int(self.lengths[i])
        return self._record(i, self.read_hidden(start, start + length))

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
        self.top_k: int = int(self.manifest["top_k"])
        self.shards = [Shard(self, record) for record in self.manifest["shards"]]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def hidden_bytes_per_token(self) -> int:
        return fmt.hidden_bytes_per_token(len(self.layer_ids), self.hidden_size, self.hidden_dtype)

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(int(s.record["tokens"]) for s in self.shards)

    def sequences(self) -> Iterator[SequenceRecord]:
        for shard in self.shards:
            yield from shard.records()

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

    def teacher_config(self) -> dict:
        return json.loads(self.fs.cat_file(self.teacher_path("config.json")))

    def load_teacher_head(self, device: str = "cpu") -> dict:
        """{'embed_tokens.weight': [V, H], 'lm_head.weight': [V, H]} as torch tensors."""
        import safetensors.torch

        path = self.teacher_path(fmt.TEACHER_HEAD)
        if not self.fs.exists(path):
            raise CacheError(f"{self.url}: the teacher head ({fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD}) is missing; rebuild the cache")
        tensors = safetensors.torch.load(self.fs.cat_file(path))
        return {k: v.to(device) for k, v in tensors.items()}

    def load_tokenizer(self):
        """The teacher's tokenizer as saved in the cache."""
        import tempfile

        from transformers import AutoTokenizer

        if fmt.is_local(self.fs):
            return AutoTokenizer.from_pretrained(self.teacher_path(""))
        with tempfile.TemporaryDirectory() as tmp:
            self.fs.get(self.teacher_path("") + "/", tmp + "/", recursive=True)
            return AutoTokenizer.from_pretrained(tmp)


def open_cache(url: str, storage_options: dict[str, Any] | None = None) -> Cache:
    """Open the cache at ``url`` (local path, file://, s3://, gs://, ...) for reading."""
    return Cache(url, storage_options)
