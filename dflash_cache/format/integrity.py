"""Whether a shard holds what its commit record says: sizes from one listing (``size_check``), the
record against the manifest (``record_problems``), checksums hashed once per process
(``part_problems``), and links that would lead reads out of the cache (``refuse_outside_links``).
Each takes a shard's ``ShardFiles`` (its store and record), never a reader's object;
``Cache.ensure_intact`` and ``dflash-cache verify`` both judge shards by these."""

from __future__ import annotations

import os
import stat
import threading

import numpy as np
import pyarrow as pa
import xxhash

from dflash_cache.format.cache_layout import (
    HIDDEN,
    SEQUENCES,
    SHARDS_DIR,
    TOKENS,
    check_shard_paths,
    checksum,
    inside_cache,
    join,
)
from dflash_cache.format.hidden import HiddenChecksumError
from dflash_cache.format.record import ShardFiles
from dflash_cache.format.store import CacheStore, file_identity, mapped_file
from dflash_cache.format.token_tables import list_width_problem
from dflash_common.errors import CacheError, quoted
from dflash_common.files import file_kind

SIZES = "sizes"
"""Not a file: every file's size against its commit record, from one listing (``quick_check``)."""


CHECKSUMMED = (SEQUENCES, TOKENS, "hidden")
"""A shard's parts that its commit record holds checksums of (``Shard.checksum_problems``); which
of them a read uses is the layout's ``read_parts`` (dflash_cache.format.versions)."""


class ShardIntegrityError(CacheError):
    """A shard's bytes differ from its commit record (``Shard.ensure_intact``); ``problems`` say how."""

    def __init__(self, url: str, shard: str, problems: list[str]):
        self.url, self.shard, self.problems = url, shard, list(problems)
        super().__init__(damaged_shards_message(url, {shard: self.problems}))


NAMED_SHARDS = 5
"""Damaged shards a one-line refusal names with their first problem (the count says the rest)."""
SKIP_LIST_SHARDS = 20
"""Up to this many damaged shards, the refusal spells out the whole --skip-shards value."""


def damaged_shards_message(url: str, problems: dict[str, list[str]]) -> str:
    """One line naming the first damaged shards, each with its first problem, the count of the rest,
    and both ways out (the --skip-shards value whole while it stays short): a line of bounded
    length however many shards are damaged."""
    named = "; ".join(f"{name} ({problem_text(bad[0])}" + (f", +{len(bad) - 1} more" if len(bad) > 1 else "") + ")"
                      for name, bad in list(problems.items())[:NAMED_SHARDS])
    if len(problems) > NAMED_SHARDS:
        named += f"; and {len(problems) - NAMED_SHARDS:,} more"
    skip = (f"--skip-shards {','.join(problems)}" if len(problems) <= SKIP_LIST_SHARDS
            else f"--skip-shards and the names `dflash-cache verify {url}` prints")
    return (f"{url}: {len(problems):,} shard(s) fail the integrity check: {named}; run `dflash-cache verify {url}` "
            f"and rebuild the cache, or train without them with {skip}")


PROBLEM_CHARS = 150
"""The most characters of one problem a message shows (a decoder's error can quote megabytes)."""


def problem_text(problem: str) -> str:
    """A problem as a message shows it: its first line, at most PROBLEM_CHARS characters."""
    line = problem.splitlines()[0] if problem else ""
    return line if len(line) <= PROBLEM_CHARS else line[:PROBLEM_CHARS - 3] + "..."


def error_problem(err: BaseException, what: str = "unreadable") -> str:
    """A decoder's exception as one short problem: "unreadable PART: TYPE: first line"."""
    return problem_text(f"{what}: {type(err).__name__}: {str(err)}")


def size_problems(expected: dict[str, int], found: dict[str, int] | None) -> list[str]:
    """Files of a commit record (relative path -> bytes) against those found; None: no folder."""
    if found is None:
        return ["shard folder missing"]
    problems = []
    for name, size in expected.items():
        if name not in found:
            problems.append(f"file {name} missing")
        elif found[name] != size:
            problems.append(f"file {name} is {found[name]} bytes, expected {size}")
    return problems


def size_check(store: CacheStore, files: dict[str, dict[str, int]], skip: set[str] | frozenset[str] = frozenset()) -> dict[str, list[str]]:
    """Problems of the shards ``files`` lists (shard name -> its commit record's files and sizes),
    except ``skip``, that one listing of ``shards/`` shows: missing folders and files, and sizes
    that differ from the commit records; a symlink in it that leaves the cache is refused
    (CacheError). Cheap enough to run whenever a format-1 cache is opened for training; the loader
    checks a shard's checksums when it first reads it, verify checks everything."""
    shards_dir = store.path(SHARDS_DIR)
    try:
        listing = store.fs.find(shards_dir, detail=True) if store.fs.exists(shards_dir) else {}
    except FileNotFoundError:
        listing = {}
    found: dict[str, dict[str, int]] = {}
    prefix = len(shards_dir) + 1
    linked = {}
    for path, info in listing.items():
        if info.get("islink"):  # the listing names links without following them: none may leave the cache
            refuse_outside_links(store, path)
            if store.local and os.path.isdir(path):  # a shard folder linked from inside the cache
                linked.update(store.fs.find(path, detail=True))
    for path, info in {**listing, **linked}.items():
        shard, _, rest = path[prefix:].partition("/")
        if rest:
            found.setdefault(shard, {})[rest] = int(info["size"])
    problems = {}
    for name, expected in files.items():
        if name not in skip:
            bad = size_problems(expected, found.get(name))
            if bad:
                problems[name] = bad
    return problems


def refuse_outside_links(store: CacheStore, path: str) -> None:
    """On local storage: refuse any symlink at or under ``path`` of the cache (files and folders,
    at any depth) that resolves outside the cache."""
    if store.local:
        _local_files(store, path)


def _local_files(store: CacheStore, path: str) -> list[tuple]:
    """(path, inode, size, mtime) of the local file ``path`` or of every file under the folder
    ``path``, in one pass that refuses any symlink resolving outside the cache. A missing path is
    FileNotFoundError."""
    root = os.path.realpath(store.root)
    if os.path.islink(path):
        inside_cache(root, path, store.url)
    if not os.path.isdir(path):
        return [(store.regular(path), *file_identity(path))]
    found, folders = [], [path]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    inside_cache(root, entry.path, store.url)
                if entry.is_dir():
                    folders.append(entry.path)
                    continue
                info = entry.stat()
                if not stat.S_ISREG(info.st_mode):
                    raise CacheError(f"{store.url}: {os.path.relpath(entry.path, store.root)} is a {file_kind(info.st_mode)}, "
                                     "not a regular file; a cache holds only regular files (this one was edited): restore "
                                     "the file or rebuild the cache with `dflash-cache build ... --overwrite`")
                found.append((entry.path, info.st_ino, info.st_size, info.st_mtime_ns))
    return sorted(found)


# Parts of local shards already hashed in this process: (part, path, identity of its files,
# expected checksum) -> problems. The identity is a hash of (inode, size, mtime) of every file, so
# a file rewritten or replaced since is hashed again.
_VERIFIED: dict[tuple, list[str]] = {}


_VERIFIED_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A lock a parent's read-ahead thread held at a fork would stay held in the child for ever."""
    global _VERIFIED_LOCK
    _VERIFIED_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


HASH_WINDOW = 64 * 2**20  # bytes hashed at a time when the hidden states go through Zarr


RECORD = "record"  # a shard's commit record (shards/NAME.json), as a part of record_problems


def record_problems(shard: ShardFiles, part: str) -> list[str]:
    """Where one part of a shard disagrees with its record (empty when it agrees; checksums are
    ``part_problems``'s): for RECORD, the commit record on disk against the manifest's; for
    sequences.arrow, the sequence count, offsets and lengths against the record; for tokens.arrow,
    the token count and the top-k width against the manifest. The one check of these, run by the
    training loader (``Shard.checksum_problems``) and by `dflash-cache verify` alike. Errors
    become problems."""
    store, record = shard.store, shard.record
    try:
        if part == RECORD:
            record_path = f"{shard.path}.json"
            if not store.fs.exists(record_path):
                return ["commit record missing"]
            try:
                on_disk = store.read_json(record_path)
            except (ValueError, CacheError):
                return ["commit record is not readable JSON"]
            check_shard_paths(on_disk, store.url, f"{SHARDS_DIR}/{shard.name}.json")
            if on_disk != record:
                differ = sorted(str(k) for k in {**on_disk, **record} if on_disk.get(k) != record.get(k))
                shown = ", ".join(quoted(k, 40) if len(k) > 40 else k for k in differ[:5])
                return [f"commit record differs from the manifest ({shown}"
                        + (f", +{len(differ) - 5:,} more" if len(differ) > 5 else "") + ")"]
        elif part == SEQUENCES:
            sequences = store.open_ipc(join(shard.path, SEQUENCES))
            if sequences.num_rows != record["sequences"]:
                return [f"{SEQUENCES} holds {sequences.num_rows} sequences, the record {record['sequences']}"]
            lengths = sequences.column("length").to_numpy()
            offsets = sequences.column("offset").to_numpy()
            if len(lengths) and (offsets[0] != 0 or np.any(offsets[1:] != np.cumsum(lengths)[:-1])
                                 or lengths.sum() != record["tokens"] or np.any(lengths < 0)):
                return ["sequence offsets and lengths are inconsistent"]
        elif part == TOKENS:
            tokens = store.open_ipc(join(shard.path, TOKENS))
            if tokens.num_rows != record["tokens"]:
                return [f"{TOKENS} holds {tokens.num_rows} tokens, the record {record['tokens']}"]
            for column in ("topk_ids", "topk_logprobs"):
                problem = list_width_problem(tokens, column, shard.spec.top_k, "top_k")
                if problem:
                    return [problem]
    except CacheError:
        raise  # a symlink out of the cache or an untrustworthy record: refused, not a damaged shard
    except FileNotFoundError as err:
        return [f"file {os.path.relpath(err.filename, shard.path) if err.filename else part} missing"]
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        return [error_problem(err, f"unreadable {part}")]
    return []


def part_problems(shard: ShardFiles, part: str) -> list[str]:
    """Problems of one part of a shard (see ``Shard.checksum_problems``); errors become problems."""
    expected = (shard.record.get("checksums") or {}).get(part)
    try:
        key = None
        if shard.store.local:  # the files' identities, symlinks leaving the cache refused on the way
            files = _local_files(shard.store, join(shard.path, HIDDEN if part == "hidden" else part))
            key = (part, shard.path, xxhash.xxh64_hexdigest(repr(files).encode()), expected)
            with _VERIFIED_LOCK:
                if key in _VERIFIED:
                    return _VERIFIED[key]
        if part == "hidden" and shard.layout.hidden_checked_as_read:
            problems = _hidden_layout(shard)  # its bytes are checked per inner chunk as they are read
        else:
            problems = _hash_hidden(shard, expected) if part == "hidden" else _hash_file(shard, part, expected)
    except CacheError:
        raise  # a symlink out of the cache: refused, not a damaged shard
    except FileNotFoundError as err:
        return [f"file {os.path.relpath(err.filename, shard.path) if err.filename else part} missing"]
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        return [error_problem(err, f"unreadable {part}")]
    if key is not None:
        with _VERIFIED_LOCK:
            _VERIFIED[key] = problems
    return problems


def _hash_file(shard: ShardFiles, name: str, expected: str | None) -> list[str]:
    path = join(shard.path, name)
    if shard.store.local:
        with pa.memory_map(path, "r") as f:  # hashed in place, not copied
            digest = xxhash.xxh64(f.read_buffer()).hexdigest()
    else:
        digest = checksum(shard.store.fs.cat_file(path))
    return [] if digest == expected else [f"{name} checksum mismatch"]


def _shape_problems(shard: ShardFiles) -> tuple[list[str], object, tuple]:
    """The stored hidden-state array's shape and dtype against the record and the manifest; also
    the fast local reader of it (None: Zarr reads it) and its shape."""
    spec = shard.spec
    want_shape = tuple(shard.record.get("hidden_shape") or ())
    want_dtype = spec.stored_dtype
    files = shard.fast_hidden
    if files is not None:
        shape, dtype = files.shape, files.dtype
    else:
        array = shard.hidden_array
        shape, dtype = tuple(array.shape), array.dtype
    if shape != want_shape:
        return [f"hidden shape {shape} differs from {want_shape}"], files, shape
    if dtype != want_dtype:
        return [f"hidden dtype {dtype} differs from {want_dtype}, the storage of the manifest's "
                f"{spec.hidden_dtype} ({spec.hidden_format})"], files, shape
    return [], files, shape


def layout_problems(shard: ShardFiles) -> list[str]:
    """The hidden-state array's shape and dtype against the record (and, format 2, its shard index
    against its crc32c and the file): what holds the rows the index promises, checked before a
    reader sizes a buffer from the index's lengths. Errors become problems."""
    try:
        return _hidden_layout(shard)
    except CacheError:
        raise
    except Exception as err:  # a damaged zarr.json can fail in any decoder; name it, do not crash
        return [error_problem(err, "unreadable hidden states")]


def _hidden_layout(shard: ShardFiles) -> list[str]:
    """A format-2 hidden-state array's shape and dtype against the record, and its shard index
    against its crc32c (local): what a reader must trust before it reads inner chunks, each
    checked as it is read."""
    problems, files, shape = _shape_problems(shard)
    if problems:
        return problems
    if files is not None and shape[0] and hasattr(files, "_map"):
        try:
            files._map()
        except HiddenChecksumError as err:
            return [f"hidden states: {err.problem}"]
    return []


def _hash_hidden(shard: ShardFiles, expected: str | None) -> list[str]:
    """The stored hidden-state array against the record: shape, dtype, then xxh64 of its bytes in
    C order (what the writer hashed), streamed from the chunk files or, through Zarr, a window at
    a time."""
    problems, files, shape = _shape_problems(shard)
    if problems:
        return problems
    digest = xxhash.xxh64()
    rows = shape[0]
    if files is not None:
        for index in range(-(-rows // files.chunk_rows) if rows else 0):
            path = files.chunk_path(index)
            needed = min(files.chunk_rows, rows - index * files.chunk_rows) * files.row_bytes
            data = mapped_file(path, *file_identity(path))
            if len(data) < needed:
                return [f"file {os.path.relpath(path, shard.path)} is short ({len(data)} of {needed} bytes)"]
            digest.update(data[:needed])
    else:
        array = shard.hidden_array
        step = max(1, HASH_WINDOW // max(1, int(np.prod(shape[1:], dtype=np.int64)) * array.dtype.itemsize))
        for lo in range(0, rows, step):
            digest.update(np.ascontiguousarray(array[lo:lo + step]).view(np.uint8).reshape(-1))
    return [] if digest.hexdigest() == expected else ["hidden states checksum mismatch"]
