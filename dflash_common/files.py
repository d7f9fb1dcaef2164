"""Durable local writes: fsync, and a file replaced whole or not at all; and what in a folder a
command that replaces or deletes its contents did not write."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from typing import BinaryIO


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one local file, or a folder (which makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file under a local folder. A shard is ~150 files and each fsync waits for a
    device flush, so they run on a few threads (measured: 0.82 s -> 0.25 s for a 614 MB shard)."""
    from concurrent.futures import ThreadPoolExecutor

    files = [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(fsync_path, files))


def write_file_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` whole (see write_atomic)."""
    write_atomic(path, lambda f: f.write(data))


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Make `path` whole with `write(file)`: into a temporary sibling (".NAME.tmp-XXXXXXXX"),
    fsynced, renamed over `path`, and the folder fsynced, so a crash leaves the old file or the new
    one; when `write` raises, the sibling is removed and the error goes on."""
    folder, name = os.path.split(os.fspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(folder or ".")


def foreign_entries(folder: str | os.PathLike, ours: Callable[[os.DirEntry], bool]) -> list[str]:
    """The sorted names in `folder` that `ours` does not claim ([] when there is no such folder):
    what a command about to replace or delete the folder's contents must refuse to touch."""
    try:
        with os.scandir(folder) as entries:
            return sorted(entry.name for entry in entries if not ours(entry))
    except (FileNotFoundError, NotADirectoryError):
        return []


def holds(names: Sequence[str]) -> str:
    """How a refusal names what a folder holds: "'a.txt'", or "'a.txt' and 3 more"."""
    return repr(names[0]) + (f" and {len(names) - 1} more" if len(names) > 1 else "")
