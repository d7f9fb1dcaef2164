"""Where a cache lives and the only code that touches its storage: one object for its file system,
root path and URL (``CacheStore``), so the three travel together instead of loose through every
signature; atomic writes, bounded JSON reads, memory maps and Arrow files; the Zarr store of an
array in it. The reader, the writer and the integrity checks all reach storage through here."""

from __future__ import annotations

import json
import mmap
import os
import stat
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from dflash_cache.format.cache_layout import inside_cache, join
from dflash_common.errors import CacheError, ConfigError, DFlashError
from dflash_common.faults import maybe_fault
from dflash_common.files import file_kind
from dflash_common.settings_files import MANIFEST_BYTES, load_settings_file


def url_to_fs(url: str, storage_options: dict[str, Any] | None = None):
    """(filesystem, root path) for a cache URL: a local path, file://, s3://, gs://, ...

    Object-store clients (s3fs, gcsfs, ...) are cached per process by their options and keep a
    listing cache, so a listing taken earlier in this process (by a build, verify, another
    open) would hide objects other clients wrote or deleted since: opening a cache starts
    from a fresh view of the store.
    """
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ValueError as err:
        if "Protocol not known" not in str(err):
            raise
        scheme = str(url).split("://", 1)[0]
        raise ConfigError(f"{url}: the URL scheme {scheme}:// is unknown; give a local path or a URL fsspec reads "
                          "(file://, s3://, gs://, ...)") from None
    except ImportError as err:  # a known scheme whose client (s3fs, gcsfs, ...) is not installed
        raise ConfigError(f"{url}: {str(err).splitlines()[0] if str(err) else 'its client is not installed'}") from None
    if not is_local(fs):
        fs.invalidate_cache()
    return fs, root.rstrip("/")


def is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def write_bytes_atomic(fs, path: str, data: bytes, fault_point: str | None = None) -> None:
    """Readers see the old content or the new, never a torn file.

    On a local file system: a temporary file in the same folder, then rename. On object stores
    a single PUT is already atomic. ``fault_point`` names the moment between the two for the
    crash tests (dflash_common.faults).
    """
    if is_local(fs):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if fault_point:
            maybe_fault(fault_point)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, data)


def write_json_atomic(fs, path: str, obj: Any, fault_point: str | None = None) -> None:
    write_bytes_atomic(fs, path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode(), fault_point)


def read_json(fs, path: str, what: str | None = None) -> Any:
    """A JSON file of a cache (manifest, shard record), bounded and parsed by the one settings reader."""
    return load_settings_file(path, what or path, "json", MANIFEST_BYTES, CacheError,
                              "rebuild the cache (dflash-cache build ... --overwrite)", fs=fs)


@contextmanager
def reaching(url: str):
    """A store's first contact: an unreachable endpoint, refused credentials or an option its client
    does not take become one line. The clients' errors share no base class (botocore's, aiohttp's,
    TypeError for an unknown option), so anything but our own errors is caught here, and only here."""
    try:
        yield
    except DFlashError:
        raise
    except Exception as err:  # noqa: BLE001 - see above
        first = str(err).splitlines()[0][:200] if str(err) else ""
        raise CacheError(f"{url}: the storage cannot be reached or refused the request ({type(err).__name__}: {first}); "
                         "check the endpoint, the credentials and --storage-options") from None


def regular_file(fs, root: str, path: str, url: str) -> str:
    """``path`` of the cache at ``root``, refused (CacheError) on local storage when a link leads it
    out of the cache or it is not a regular file (a FIFO would block the read, a device such as
    /dev/zero would never end); a missing file is left to the reader (FileNotFoundError). Every file
    a command opens in a cache passes through here first; object stores hold only objects."""
    if not is_local(fs):
        return path
    inside_cache(os.path.realpath(root), path, url)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(mode):
        raise CacheError(f"{url}: {os.path.relpath(path, root)} is a {file_kind(mode)}, not a regular file; a cache holds "
                         "only regular files (this one was edited or is not a dflash cache): restore the file or rebuild "
                         "the cache with `dflash-cache build ... --overwrite`")
    return path


def open_ipc(fs, path: str) -> pa.Table:
    """An Arrow IPC file: memory-mapped on local storage, fetched whole from an object store."""
    if is_local(fs):
        return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()
    return pa.ipc.open_file(pa.BufferReader(fs.cat_file(path))).read_all()


@lru_cache(maxsize=64)
def mapped_file(path: str, inode: int, size: int, mtime_ns: int) -> np.ndarray:
    """A read-only map of a whole local file as uint8, kept for the next reads of the same file
    (the identity arguments make a changed file a new entry)."""
    if size == 0:
        return np.empty(0, dtype=np.uint8)  # mmap refuses empty files
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def file_identity(path: str) -> tuple[int, int, int]:
    """(inode, size, mtime) of a local file: what tells a rewritten or replaced file from the one read before."""
    info = os.stat(path)
    return info.st_ino, info.st_size, info.st_mtime_ns


@dataclass(frozen=True)
class CacheStore:
    """A cache's storage: ``fs`` (fsspec), ``root`` (its path on ``fs``) and ``url`` (as the user gave
    it, for messages)."""

    fs: Any
    root: str
    url: str

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None = None) -> "CacheStore":
        fs, root = url_to_fs(url, storage_options)
        return cls(fs, root, url)

    @property
    def local(self) -> bool:
        return is_local(self.fs)

    def path(self, *parts: str) -> str:
        """The path of ``parts`` (relative, '/'-separated) under the root."""
        return join(self.root, *parts)

    def regular(self, path: str) -> str:
        """``path``, checked to be a regular file inside the cache (``regular_file``)."""
        return regular_file(self.fs, self.root, path, self.url)

    def read_json(self, path: str, what: str | None = None) -> Any:
        return read_json(self.fs, self.regular(path), what)

    def open_ipc(self, path: str) -> pa.Table:
        return open_ipc(self.fs, self.regular(path))

    def zarr_store(self, path: str, read_only: bool):
        return zarr_store(self.fs, path, read_only)

    # The write side (the writer, the build) and the build's own looks at its output folder: the
    # file system's operations on paths of this cache, so no code outside the store holds an ``fs``.
    def read_json_unchecked(self, path: str, what: str | None = None) -> Any:
        """``read_json`` without the regular-file check: a build reading back what it wrote itself."""
        return read_json(self.fs, path, what)

    def write_bytes_atomic(self, path: str, data: bytes, fault_point: str | None = None) -> None:
        write_bytes_atomic(self.fs, path, data, fault_point)

    def write_json_atomic(self, path: str, obj: Any, fault_point: str | None = None) -> None:
        write_json_atomic(self.fs, path, obj, fault_point)

    def write_file(self, path: str, data: bytes) -> None:
        """One file written whole (a single PUT on object stores; not atomic on local storage)."""
        self.fs.pipe_file(path, data)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.fs.isfile(path)

    def ls(self, path: str, detail: bool = False) -> list:
        return self.fs.ls(path, detail=detail)

    def glob(self, pattern: str) -> list[str]:
        return self.fs.glob(pattern)

    def file_sizes(self, folder: str) -> dict[str, int]:
        """Every file under ``folder``, by its path below it, with its size."""
        return {path[len(folder) + 1:]: int(info["size"]) for path, info in self.fs.find(folder, detail=True).items()}

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def rm(self, path: str, recursive: bool = False) -> None:
        self.fs.rm(path, recursive=recursive)

    def mv(self, source: str, target: str, recursive: bool = False) -> None:
        self.fs.mv(source, target, recursive=recursive)

    def forget(self, path: str) -> None:
        """Drop the file system's cached listing of ``path`` (objects written through another client)."""
        self.fs.invalidate_cache(path)


def zarr_store(fs, path: str, read_only: bool):
    """The Zarr store of the array at ``path`` on ``fs``."""
    import zarr

    if is_local(fs):
        return zarr.storage.LocalStore(path, read_only=read_only)
    # Zarr needs an async file system: this makes (or reuses) an asynchronous twin of ``fs`` with
    # the same options. It keeps its own listing cache, blind to what ``fs`` and other clients
    # did since; start it fresh so a size or listing it cached earlier is not trusted.
    store = zarr.storage.FsspecStore.from_url(fs.unstrip_protocol(path), storage_options=fs.storage_options,
                                              read_only=read_only)
    store.fs.invalidate_cache()
    return store
