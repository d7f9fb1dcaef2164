"""teacher/: the teacher's frozen files a cache carries for stage 2 (config.json, the tokenizer's
files, head.safetensors), checked before any of them is read.

A cache may come from anyone, and transformers reads these files whole and parses their JSON
recursively: a tokenizer file that is a 3 GiB sparse file ended `run` in a MemoryError, a
config.json nested 400k levels deep in a RecursionError, a FIFO would block the read. So every
entry of the folder must be a regular file inside the cache (no link out of it, no FIFO or
device), at most TEACHER_FILE_BYTES (the head excepted: the manifest records its size, which
its reader checks), and a JSON file at most TEACHER_JSON_DEPTH deep and parsable. The reader
checks the folder before it hands out the tokenizer or the config; ``verify`` reports each
problem.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from dflash_cache.format.cache_layout import TEACHER_DIR, TEACHER_HEAD, join
from dflash_cache.format.store import CacheStore
from dflash_common.errors import CacheError, shown
from dflash_common.files import file_kind
from dflash_common.settings_files import json_depth, parse_settings

TEACHER_FILE_BYTES = 256 << 20
"""Largest teacher file but the head. Far above any tokenizer or config (tokenizer.json of a
262,144-token vocabulary is ~33 MB, tokenizer.model ~4 MB, a config ~10 kB), far below what a
process reading it whole can hold."""

TEACHER_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects in a teacher JSON file. Real ones nest under 10 levels
(tokenizer.json's normalizer and pre-tokenizer sequences); Python's JSON parser recurses per level
and the tokenizers library's stops at 128."""

TEACHER_FILES = 256
"""Most entries teacher/ may hold: a tokenizer and config are ~10 files."""

FIX = "restore the teacher's files (or rebuild the cache with `dflash-cache build ... --overwrite`)"


def file_problem(name: str, size: int, data: bytes | None = None) -> str | None:
    """What is wrong with the regular file ``name`` (its path below teacher/) of ``size`` bytes,
    whose bytes (``data``, for a JSON file within the size bound) are its content; None when
    nothing is. Pure: the size bound, then the depth bound, then whether its JSON parses."""
    if name == TEACHER_HEAD:
        return None  # bounded by the size the manifest records (Cache.teacher_head_bytes)
    if size > TEACHER_FILE_BYTES:
        return (f"is {size:,} bytes, more than the {TEACHER_FILE_BYTES >> 20} MiB a teacher's config or tokenizer file "
                "may be")
    if data is None or not name.endswith(".json"):
        return None
    depth = json_depth(data)
    if depth > TEACHER_JSON_DEPTH:
        return f"nests {depth:,} levels deep, more than the {TEACHER_JSON_DEPTH} a teacher's JSON file may"
    try:
        parse_settings(data, "it", "json", CacheError, "")
    except CacheError as err:
        return str(err).removeprefix("it ").rstrip("; ")
    return None


def _local_entries(store: CacheStore, folder: str) -> Iterator[tuple[str, int | None, str | None]]:
    """(name below teacher/, size, problem) of every entry under the local ``folder``: a link is
    followed only to a file inside the cache (never to a folder: a link to its own parent would
    loop), and anything but a regular file or a folder is a problem."""
    root = os.path.realpath(store.root)
    if os.path.commonpath([root, os.path.realpath(folder)]) != root:
        yield "", None, f"is a symlink to {shown(os.path.realpath(folder))}, outside the cache"
        return
    folders = [folder]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                name = os.path.relpath(entry.path, folder)
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if os.path.commonpath([root, target]) != root:
                        yield name, None, f"is a symlink to {shown(target)}, outside the cache"
                        continue
                try:
                    info = os.stat(entry.path)
                except OSError:
                    yield name, None, "is a symlink to nothing"
                    continue
                if stat.S_ISDIR(info.st_mode):
                    if entry.is_symlink():
                        yield name, None, "is a symlink to a folder, not a file"
                    else:
                        folders.append(entry.path)
                elif not stat.S_ISREG(info.st_mode):
                    yield name, None, f"is a {file_kind(info.st_mode)}, not a regular file"
                else:
                    yield name, info.st_size, None


def _entries(store: CacheStore, folder: str) -> Iterator[tuple[str, int | None, str | None]]:
    if store.local:
        yield from _local_entries(store, folder)
        return
    for path, info in store.fs.find(folder, detail=True).items():  # object stores hold only objects
        yield path[len(folder) + 1:], int(info["size"]), None


def teacher_file_problems(store: CacheStore) -> list[str]:
    """Every problem of the cache's teacher/ folder (empty: none, or no folder), each one line
    "teacher/NAME PROBLEM"; file_problem for each regular file, reading only the JSON ones within
    the size bound."""
    folder = join(store.root, TEACHER_DIR)
    if not store.fs.exists(folder):
        return []
    problems, seen = [], 0
    for name, size, problem in _entries(store, folder):
        seen += 1
        if seen > TEACHER_FILES:
            problems.append(f"{TEACHER_DIR}/ holds more than {TEACHER_FILES} entries, more than a teacher's files are")
            break
        if problem is None:
            data = None
            if name.endswith(".json") and size is not None and size <= TEACHER_FILE_BYTES:
                with store.fs.open(join(folder, name), "rb") as f:
                    data = f.read(TEACHER_FILE_BYTES + 1)  # a file grown since its size was read stays bounded
                size = max(size, len(data))
            problem = file_problem(name, size, data)
        if problem is not None:
            problems.append(f"{TEACHER_DIR}/{shown(name) if name else ''} {problem}")
    return problems


def check_teacher_files(store: CacheStore) -> None:
    """Refuse (CacheError, one line) a teacher/ folder with a problem (teacher_file_problems)."""
    problems = teacher_file_problems(store)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s): run `dflash-cache verify`)" if len(problems) > 1 else ""
        raise CacheError(f"{store.url}: {problems[0]}{more}; the cache's teacher files were edited or are not a "
                         f"dflash build's: {FIX}")
