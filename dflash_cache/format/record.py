"""A committed shard as the format knows it: where its files are and what its commit record says
(``ShardFiles``, what the integrity checks and the reader take), and the commit record a writer
makes of a finished shard's files."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from dflash_cache.format.cache_layout import HIDDEN, join
from dflash_cache.format.manifest import ArraySpec
from dflash_cache.format.store import CacheStore


@dataclass(eq=False)
class ShardFiles:
    """One committed shard of a cache: its storage, the cache's array spec, the layout of the
    cache's format version (dflash_cache.format.versions), its name, and its commit record, loaded
    on first use (format 2 makes it from a row of the index)."""

    store: CacheStore
    spec: ArraySpec
    layout: Any
    name: str
    load_record: Callable[[], dict] = field(repr=False)

    @cached_property
    def path(self) -> str:
        """The shard's folder (its commit record is this path + '.json')."""
        return self.layout.shard_path(self.store.root, self.name)

    @cached_property
    def record(self) -> dict:
        return self.load_record()

    @cached_property
    def fast_hidden(self):
        """The fast local reader of the hidden states (format 1: chunk files; format 2: the shard
        object), or None: Zarr reads them (compressed, remote, or another layout)."""
        if not self.store.local:
            return None
        self._check_hidden_files()
        return self.layout.open_hidden(join(self.path, HIDDEN))

    def _check_hidden_files(self) -> None:
        """The hidden-state files opened by name: regular files inside the cache (a FIFO would block
        Zarr's read, a link to /dev/zero would never end)."""
        for name in self.layout.hidden_files:
            self.store.regular(join(self.path, HIDDEN, name))

    @cached_property
    def hidden_array(self):
        """The hidden-state array through Zarr (whose codecs check format 2's crc32c)."""
        import zarr

        self._check_hidden_files()
        return zarr.open_array(self.store.zarr_store(join(self.path, HIDDEN), read_only=True), mode="r")


def commit_record(store: CacheStore, final_dir: str, name: str, rank: int, index: int, rows: tuple[int, int], sequences: int,
                  loss_tokens: int, hidden_shape: tuple[int, int, int], chunk_tokens: int, checksums: dict,
                  skipped: dict, capture: dict | None = None) -> dict:
    """The commit record of a shard whose files are in place at ``final_dir``: its counts, hidden
    shape, inner-chunk length, checksums and every file's size, as the manifest (format 1) or the
    index (format 2) lists it."""
    files = store.file_sizes(final_dir)
    n_tokens, n_layers, hidden_size = hidden_shape
    return {
        "name": name,
        "rank": rank,
        "index": index,
        "rows": [rows[0], rows[1]],
        "sequences": sequences,
        "tokens": int(n_tokens),
        "loss_tokens": int(loss_tokens),
        "bytes": sum(files.values()),
        "hidden_shape": [int(n_tokens), int(n_layers), int(hidden_size)],
        "chunk_tokens": int(chunk_tokens),
        "checksums": checksums,
        "files": dict(sorted(files.items())),
        "skipped": dict(skipped),
        **({"health": capture} if capture is not None else {}),
    }
