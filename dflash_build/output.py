"""A build's output folder, before anything is computed: refusing a folder that is not a dflash cache
or holds one built with other settings (``RESUME_KEYS``), deleting a cache on --overwrite (only what
a build wrote), making the folder, and the name of the lock file that keeps one build per rank of a
folder.
"""

from __future__ import annotations

import re

from dflash_build.commit import RANKS_DIR
from dflash_cache import format as fmt
from dflash_cache.format.store import CacheStore
from dflash_common.errors import CacheError
from dflash_common.resume_check import first_difference

# Manifest fields that must match for a rerun to resume into an existing cache.
RESUME_KEYS = ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype", "hidden_format", "corpus", "content_options")

# One writer per rank of a cache: each rank writes only its own shards (shard-rRRRRR-*), so two
# ranks of one torchrun build share the folder, and two builds of the same rank are refused.
_LOCK = re.compile(r"^\.dflash-r\d{5}\.lock$")

# Names a build writes under shards/: shard folders, their commit records and temporaries (format
# 1), and the rank folders holding them (format 2).
_RANK_FOLDER = re.compile(r"^r\d{5}$")
_SHARD_ENTRY = re.compile(r"^(\.?(tmp-)?shard-r\d{5}-\d{6}(\.json)?(-[0-9a-f]{8})?(\.tmp-[0-9a-f]+)?|r\d{5})$")


def _resume_view(manifest: dict, key: str):
    value = manifest.get(key)
    if key == "teacher" and isinstance(value, dict):  # the hashes identify it; the path may move
        value = {k: v for k, v in value.items() if k not in ("name", "revision")}
    if key == "hidden_format":  # caches from before fp8 existed are lossless
        value = fmt.hidden_format_of(manifest)
    return value


def _mismatch(existing: dict, header: dict) -> str | None:
    return first_difference(existing, header, RESUME_KEYS, view=_resume_view, earlier_name="cache", now_name="this build")


def is_manifest_leftover(path: str) -> bool:
    """A temporary manifest left by a build killed before its first rename (local storage)."""
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(f"{fmt.MANIFEST}.tmp-")


def _is_index_leftover(store: CacheStore, path: str) -> bool:
    """A format-2 build killed at its first manifest write: its index part was written first."""
    return path.rstrip("/").rsplit("/", 1)[-1] == fmt.INDEX_DIR and store.isdir(path) \
        and _foreign_entry(store, path, _BUILD_ENTRIES[fmt.INDEX_DIR]) is None


def _is_lock(path: str) -> bool:
    """A rank's lock file (lock_name): a build takes it before it writes its manifest."""
    return bool(_LOCK.match(path.rstrip("/").rsplit("/", 1)[-1]))


def lock_name(rank: int) -> str:
    return f".dflash-r{rank:05d}.lock"


# What a build writes in each of a cache's folders: is entry ``name`` (of ``kind``) one of ours?
_BUILD_ENTRIES = {
    fmt.SHARDS_DIR: lambda name, kind: bool(_SHARD_ENTRY.match(name)),
    fmt.INDEX_DIR: lambda name, kind: name in (fmt.SHARD_TABLE, fmt.SEQUENCE_TABLE) or bool(_RANK_FOLDER.match(name)),
    fmt.TEACHER_DIR: lambda name, kind: kind == "file",
    RANKS_DIR: lambda name, kind: kind == "file" and name.startswith("rank-"),
}


def _foreign_entry(store: CacheStore, folder: str, ours, prefix: str = "") -> str | None:
    """The first entry under ``folder`` a build did not write (its path below the folder), or None.
    Format 2's rank folders under shards/ are looked into: they hold shards and the rank's .tmp."""
    for entry in store.ls(folder, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if prefix and name == ".tmp" and entry.get("type") == "directory":
            continue  # the rank's work folder (writer.work_folder): half-written shards
        if not ours(name, entry.get("type")) or (prefix and _RANK_FOLDER.match(name)):
            return prefix + name
        if not prefix and _RANK_FOLDER.match(name) and entry.get("type") == "directory":
            inner = _foreign_entry(store, entry["name"], ours, prefix=f"{name}/")
            if inner is not None:
                return inner
    return None


def _delete_cache(store: CacheStore) -> None:
    """--overwrite on a dflash cache: delete what a build wrote (manifest, shards/, index/, teacher/,
    ranks/); anything else in those folders stops it before a file is deleted."""
    doomed = []
    for sub, ours in _BUILD_ENTRIES.items():
        folder = store.path(sub)
        if not store.exists(folder):
            continue
        foreign = _foreign_entry(store, folder, ours)
        if foreign is not None:
            raise CacheError(f"{store.url}: {sub}/{foreign} is not a file dflash writes; --overwrite deletes only what a "
                             "build made, so nothing was deleted: move it out of the cache and rerun")
        doomed.append(folder)
    for folder in doomed:
        store.rm(folder, recursive=True)
    store.rm(store.path(fmt.MANIFEST))


def existing_manifest(store: CacheStore) -> dict | None:
    """The manifest of the cache at --out (None: a new or empty folder); refuses a file, a
    non-empty folder without one, and another tool's manifest. Read-only: checked before the
    build's lock file is made, so a folder that is not ours is never written into."""
    url, root = store.url, store.root
    manifest_path = store.path(fmt.MANIFEST)
    if store.isfile(root):
        raise CacheError(f"--out {url} is a file, not a folder; choose a new or empty folder for the cache")
    if not store.exists(manifest_path) and store.exists(root):
        others = [p for p in store.ls(root) if not is_manifest_leftover(p) and not _is_lock(p)
                  and not _is_index_leftover(store, p)]
        # checked again after the listing: another rank of this build writes the manifest first,
        # and may have done so since the first check (then the listing shows it, or its shards)
        if others and not store.exists(manifest_path):
            raise CacheError(f"{url} is a non-empty folder without a dflash manifest; choose an empty or new --out")
    if not store.exists(manifest_path):
        return None
    try:
        existing = store.read_json_unchecked(manifest_path)
    except ValueError:
        existing = None
    if not isinstance(existing, dict) or existing.get("format") != fmt.FORMAT_NAME:
        raise CacheError(f"{url} holds a manifest.json that is not a dflash cache's; choose another --out "
                         "(--overwrite deletes only dflash caches)")
    return existing


def prepare_output(store: CacheStore, header: dict, overwrite: bool, new_version: int = fmt.FORMAT_VERSION) -> int:
    """Refuse a folder holding another build's cache (unless --overwrite deletes it), and make
    the folder (local storage) or check its bucket exists (object stores). Returns the format
    version this build writes, also set in ``header``: a format-1 cache is resumed as format 1
    (its shards stay as they are), anything new is ``new_version`` (--format-version)."""
    url, root = store.url, store.root
    existing = existing_manifest(store)
    version = new_version
    if existing is not None:
        if not overwrite:  # an overwrite deletes a damaged manifest like any other
            fmt.check_resumed_fields(existing, url)
        readable = existing.get("format_version") in fmt.READ_VERSIONS and not isinstance(existing.get("format_version"), bool)
        problem = _mismatch(existing, header) if readable else "format version differs"
        if problem and not overwrite:
            raise CacheError(f"{url} holds a cache built with other settings: {problem}; rerun with the original settings to resume, or pass --overwrite to replace it")
        if overwrite:
            _delete_cache(store)
        else:
            version = int(existing["format_version"])
    header["format_version"] = version
    if store.local:
        # only the root: the manifest is the first thing a build writes, so a build killed before
        # it leaves at most a temporary manifest, which the rerun accepts (see is_manifest_leftover)
        store.makedirs(root)
    elif not store.exists(root.split("/", 1)[0]):  # makedirs would silently create a mistyped bucket
        raise CacheError(f"{url}: the bucket {root.split('/', 1)[0]!r} does not exist; create it or fix --out")
    return version
