"""Where everything of a cache is: file and folder names, shard names and paths, the check that a
name read from a cache cannot leave it, and the checksum every record holds.

Layout of a format-2 cache at URL ``root`` (see docs/cache-format.md; format 1 is still read):

    manifest.json                            header, totals and a pointer to the index (kilobytes)
    index/shards.arrow, index/sequences.arrow the merged index of a complete cache
    index/r00000/shards.arrow, ...           rank 0's part of the index (checkpointed while it builds)
    teacher/                                 frozen teacher pieces for stage 2 (head, config, tokenizer)
    shards/r00000/shard-r00000-000000/       one committed shard: hidden.zarr (one shard object with
                                             crc32c per inner chunk), tokens.arrow, sequences.arrow
    shards/r00000/shard-r00000-000000.json   the shard's commit record, written last

Format 1 put every shard in ``shards/<name>/`` with one file per Zarr chunk and listed every
commit record, chunk files included, in manifest.json (dflash_cache.format.v1).
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import xxhash

from dflash_common.errors import CacheError, quoted

MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
TEACHER_DIR = "teacher"
TEACHER_HEAD = "head.safetensors"
HIDDEN = "hidden.zarr"
TOKENS = "tokens.arrow"
SEQUENCES = "sequences.arrow"
INDEX_DIR = "index"
SHARD_TABLE = "shards.arrow"
SEQUENCE_TABLE = "sequences.arrow"
# The files of a format-2 shard, in the order of the shard table's file_bytes column: a constant
# number whatever the chunk size (the hidden states are one Zarr shard object).
HIDDEN_META = f"{HIDDEN}/zarr.json"
HIDDEN_DATA = f"{HIDDEN}/c/0/0/0"
V2_FILES = (HIDDEN_META, HIDDEN_DATA, TOKENS, SEQUENCES)


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def rank_folder(rank: int) -> str:
    """A rank's subfolder under shards/ and index/ (format 2): objects spread over one prefix per rank."""
    return f"r{rank:05d}"


def rank_of(name: str) -> int:
    """The writing rank in a shard name (shard-rRRRRR-IIIIII)."""
    return int(name[7:].split("-", 1)[0])


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:05d}-{index:06d}"


SHARD_NAME = r"shard-r\d{5,9}-\d{6,12}"
"""Every name ``shard_name`` makes (ranks under 10^9, indices under 10^12), as the one pattern a
shard name read from a manifest, a commit record or the index must match in full: plain, and
short (a name is printed back in messages and parsed as numbers)."""


def checksum(data: bytes | memoryview | np.ndarray) -> str:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return xxhash.xxh64(data).hexdigest()


def _path_problem(path: Any, shard: bool) -> str | None:
    """Why a name read from a cache could leave it (None: it cannot)."""
    if not isinstance(path, str) or not path:
        return "is empty" if path == "" else f"is not a string ({type(path).__name__})"
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", path):
        return "has a URL scheme"
    if "\\" in path or "\0" in path:
        return "has a backslash or NUL character"
    if path.startswith("/"):
        return "is an absolute path"
    parts = path.split("/")
    if ".." in parts:
        return "has a '..' component"
    if shard and len(parts) > 1:
        return "has a path separator"
    if "" in parts or "." in parts:
        return "has an empty or '.' component"
    if shard and not re.fullmatch(SHARD_NAME, path):
        return "is not a shard name (shard-rRRRRR-IIIIII)"
    return None


def check_shard_paths(record: Any, url: str, source: str = MANIFEST) -> dict:
    """Refuse a shard record (from manifest.json or a commit record) whose paths could leave the
    cache: the shard name must be a plain ``shard-rRRRRR-IIIIII`` (see `shard_name`) and every file
    it lists a relative path inside the shard, with no ``..``, absolute path, URL scheme, empty
    part or backslash. The one check of untrusted names; the reader and verify call it before any
    name becomes a path."""
    what = "the manifest" if source == MANIFEST else f"the commit record {source}"
    fix = (f"{what} is not trustworthy (edited or damaged): rebuild the cache with `dflash-cache build ... "
           f"--overwrite`, or restore or fix {source}")
    if not isinstance(record, dict):
        raise CacheError(f"{url}: {source} lists a shard that is a {type(record).__name__}, not a record; {fix}")
    name = record.get("name")
    bad = _path_problem(name, shard=True)
    if bad:
        raise CacheError(f"{url}: {source} names a shard {quoted(name)}, which {bad}; {fix}")
    files = record.get("files", {})
    for path in files if isinstance(files, dict) else [files]:
        bad = _path_problem(path, shard=False) if isinstance(files, dict) else "is not a table of files"
        if bad:
            raise CacheError(f"{url}: {source} lists a file {quoted(path)} of shard {name}, which {bad}; {fix}")
    return record


def inside_cache(root: str, path: str, url: str) -> None:
    """Refuse ``path`` when it resolves (symlinks followed) outside the real folder ``root``."""
    target = os.path.realpath(path)
    if os.path.commonpath([root, target]) != root:
        raise CacheError(f"{url}: {path} is a symlink to {target}, outside the cache; the cache is not trustworthy "
                         "(a cache holds its own files): replace the link with the files it points to, or rebuild the "
                         "cache with `dflash-cache build ... --overwrite`")
