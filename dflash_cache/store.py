"""Where a cache lives: one object for its file system, root path and URL (``CacheStore``), so the
three travel together instead of loose through every signature, and the Zarr store of an array in
it. The reader, the writer and the integrity checks all reach storage through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zarr

from dflash_cache import format as fmt


@dataclass(frozen=True)
class CacheStore:
    """A cache's storage: ``fs`` (fsspec), ``root`` (its path on ``fs``) and ``url`` (as the user gave
    it, for messages)."""

    fs: Any
    root: str
    url: str

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None) -> "CacheStore":
        fs, root = fmt.url_to_fs(url, storage_options)
        return cls(fs, root, url)

    @property
    def local(self) -> bool:
        return fmt.is_local(self.fs)

    def path(self, *parts: str) -> str:
        """The path of ``parts`` (relative, '/'-separated) under the root."""
        return fmt.join(self.root, *parts)

    def shard_path(self, name: str, version: int) -> str:
        return fmt.shard_path(self.root, name, version)

    def read_json(self, path: str, what: str | None = None) -> Any:
        return fmt.read_json(self.fs, path, what)

    def zarr_store(self, path: str, read_only: bool):
        return zarr_store(self.fs, path, read_only)


def zarr_store(fs, path: str, read_only: bool):
    """The Zarr store of the array at ``path`` on ``fs``."""
    if fmt.is_local(fs):
        return zarr.storage.LocalStore(path, read_only=read_only)
    # Zarr needs an async file system: this makes (or reuses) an asynchronous twin of ``fs`` with
    # the same options. It keeps its own listing cache, blind to what ``fs`` and other clients
    # did since; start it fresh so a size or listing it cached earlier is not trusted.
    store = zarr.storage.FsspecStore.from_url(fs.unstrip_protocol(path), storage_options=fs.storage_options,
                                              read_only=read_only)
    store.fs.invalidate_cache()
    return store
