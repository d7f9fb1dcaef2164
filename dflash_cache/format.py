"""The cache format: names, schemas, dtypes, the layout and the manifest. This module is its
single owner; the files' encodings sit next to it (dflash_cache.index: the shard and sequence
tables of format 2; dflash_cache.hidden_files: the hidden-state arrays; dflash_cache.shard_files:
the token tables as read).

Layout of a format-2 cache at URL ``root`` (see docs/cache-format.md; format 1 is still read):

    manifest.json                            header, totals and a pointer to the index (kilobytes)
    index/shards.arrow, index/sequences.arrow the merged index of a complete cache
    index/r00000/shards.arrow, ...           rank 0's part of the index (checkpointed while it builds)
    teacher/                                 frozen teacher pieces for stage 2 (head, config, tokenizer)
    shards/r00000/shard-r00000-000000/       one committed shard: hidden.zarr (one shard object with
                                             crc32c per inner chunk), tokens.arrow, sequences.arrow
    shards/r00000/shard-r00000-000000.json   the shard's commit record, written last

Format 1 put every shard in ``shards/<name>/`` with one file per Zarr chunk and listed every
commit record, chunk files included, in manifest.json.
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from typing import Any

import fsspec
import ml_dtypes
import numpy as np
import pyarrow as pa
import xxhash

from dflash_cache import fp8
from dflash_cache.settings.storage_config import HIDDEN_FORMATS, LOSSLESS
from dflash_common.errors import CacheError, ConfigError, DFlashError, quoted
from dflash_common.faults import maybe_fault
from dflash_common.settings_files import MANIFEST_BYTES, load_settings_file

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 2
"""What a new build writes."""
READ_VERSIONS = (1, 2)
"""What the reader reads. A build over a format-1 cache resumes it as format 1."""

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


def rank_folder(rank: int) -> str:
    """A rank's subfolder under shards/ and index/ (format 2): objects spread over one prefix per rank."""
    return f"r{rank:05d}"


def rank_of(name: str) -> int:
    """The writing rank in a shard name (shard-rRRRRR-IIIIII)."""
    return int(name[7:].split("-", 1)[0])


def shard_path(root: str, name: str, version: int) -> str:
    """The folder of shard ``name`` (its commit record is this path + '.json')."""
    if version == 1:
        return join(root, SHARDS_DIR, name)
    return join(root, SHARDS_DIR, rank_folder(rank_of(name)), name)

# Stored dtype of the hidden states, keyed by the true dtype recorded in the manifest. Zarr 3 has
# no bfloat16, so bf16 is stored as its 16-bit pattern and viewed back on read (lossless).
HIDDEN_STORAGE = {
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
}
HIDDEN_NUMPY = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}

# How the hidden states are encoded (the manifest's ``hidden_format``; absent means lossless).
# lossless: the true dtype's bits, as above. fp8_e4m3: uint8 e4m3 codes in hidden.zarr and one
# power-of-two scale exponent per token per layer in the SCALE_COLUMN of tokens.arrow (see
# dflash_cache.fp8); the reader decodes them to the true dtype. The names (LOSSLESS, HIDDEN_FORMATS)
# are settings of a build: dflash_cache.settings.storage_config.
SCALE_COLUMN = "hidden_scale_exp"


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:05d}-{index:06d}"


SHARD_NAME = r"shard-r\d{5,9}-\d{6,12}"
"""Every name ``shard_name`` makes (ranks under 10^9, indices under 10^12), as the one pattern a
shard name read from a manifest, a commit record or the index must match in full: plain, and
short (a name is printed back in messages and parsed as numbers)."""


def sequences_schema() -> pa.Schema:
    """One row per sequence; its tokens are rows offset..offset+length of the token table."""
    return pa.schema(
        [
            ("id", pa.string()),
            ("offset", pa.int64()),
            ("length", pa.int32()),
            ("row", pa.int64()),
            ("truncated", pa.bool_()),
        ]
    )


def tokens_schema(top_k: int, scale_layers: int = 0) -> pa.Schema:
    """One row per token, sequences packed back to back in shard order. fp8 caches add the
    per-layer scale exponents of the token's hidden states (``scale_layers`` = number of layers)."""
    fields = [
        ("input_ids", pa.int32()),
        ("loss_mask", pa.uint8()),
        ("topk_ids", pa.list_(pa.int32(), top_k)),
        ("topk_logprobs", pa.list_(pa.float32(), top_k)),
    ]
    if scale_layers:
        fields.append((SCALE_COLUMN, pa.list_(pa.int8(), scale_layers)))
    return pa.schema(fields)


def hidden_format_of(manifest: dict) -> str:
    """The manifest's hidden_format; caches written before fp8 existed are lossless."""
    return manifest.get("hidden_format") or LOSSLESS


def stored_dtype(hidden_dtype: str, hidden_format: str = LOSSLESS) -> np.dtype:
    """The Zarr data type of the hidden-state array."""
    return fp8.CODE_DTYPE if hidden_format == fp8.FORMAT else HIDDEN_STORAGE[hidden_dtype]


def hidden_bytes_per_token(num_layers: int, hidden_size: int, hidden_dtype: str, hidden_format: str = LOSSLESS) -> int:
    """Stored hidden-state bytes per token, fp8 scale exponents included."""
    scales = num_layers * fp8.EXP_DTYPE.itemsize if hidden_format == fp8.FORMAT else 0
    return num_layers * hidden_size * stored_dtype(hidden_dtype, hidden_format).itemsize + scales


def token_bytes_per_token(top_k: int) -> int:
    """Arrow payload per token: input id, mask, k ids and k log-probs."""
    return 4 + 1 + top_k * (4 + 4)


def from_storage(stored: np.ndarray, hidden_dtype: str) -> np.ndarray:
    """Reinterpret stored hidden states as their true dtype, without copying."""
    return stored.view(HIDDEN_NUMPY[hidden_dtype])


def decode_hidden(stored: np.ndarray, scale_exponents: np.ndarray | None, hidden_dtype: str,
                  hidden_format: str = LOSSLESS) -> np.ndarray:
    """Stored hidden-state rows (and, for fp8, their scale exponents) -> the true dtype. Lossless
    rows are reinterpreted without a copy; fp8 rows are decoded exactly (dflash_cache.fp8)."""
    if hidden_format == fp8.FORMAT:
        return fp8.dequantize(stored, scale_exponents, hidden_dtype)
    return from_storage(stored, hidden_dtype)


def checksum(data: bytes | memoryview | np.ndarray) -> str:
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return xxhash.xxh64(data).hexdigest()


# The teacher head (teacher/head.safetensors) is checked like a shard: the manifest's
# ``teacher_head`` records its size and checksum at build (absent in caches built before it was
# recorded: then it is not checked, and verify says so). Its tensors must be floating point of
# these dtypes: the drafter's LM head and embedding are used as they are.
TEACHER_HEAD_TENSORS = ("embed_tokens.weight", "lm_head.weight")
TEACHER_HEAD_DTYPES = ("float16", "bfloat16", "float32")


def teacher_head_record(data: bytes) -> dict:
    """The manifest's ``teacher_head`` entry for the head file's bytes."""
    return {"bytes": len(data), "checksum": checksum(data)}


def teacher_head_problem(data: bytes, record: Any) -> str | None:
    """What is wrong with the head's bytes against the manifest's record (None: they match, or
    no record exists: see teacher_head_checked)."""
    if not isinstance(record, dict):
        return None
    if len(data) != record.get("bytes"):
        return f"is {len(data):,} bytes, the manifest records {quoted(record.get('bytes'))}"
    if checksum(data) != record.get("checksum"):
        return "does not match the checksum the manifest records (damaged or changed since the build)"
    return None


def teacher_head_checked(manifest: dict) -> bool:
    """Whether the manifest records the head's checksum (caches built before it do not)."""
    return isinstance(manifest.get("teacher_head"), dict)


# --- file system helpers -------------------------------------------------------------------


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


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


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


# --- manifest --------------------------------------------------------------------------------


# Fields of a shard record that readers use; a record without one is damaged.
SHARD_RECORD_FIELDS = ("name", "sequences", "tokens", "bytes", "files", "checksums")
# Bounds on the manifest's sizes, far above any model's (vocabularies reach 262,144 tokens, hidden
# sizes 25,600): a reader allocates by them before it reads a shard, so an edited manifest's 10**9
# would end in an allocation failure rather than a refusal.
MAX_TOP_K = 2**20
MAX_HIDDEN_SIZE = 2**17


def check_manifest(manifest: dict, url: str) -> dict:
    """Refuse manifests this code cannot read, naming the fix."""
    if not isinstance(manifest, dict):
        raise CacheError(f"{url}: manifest.json holds a JSON {type(manifest).__name__}, not an object; the cache is "
                         "damaged or not a dflash cache: rebuild it")
    if manifest.get("format") != FORMAT_NAME:
        raise CacheError(f"{url}: manifest.json is not a dflash cache manifest (format={quoted(manifest.get('format'))})")
    version = manifest.get("format_version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise CacheError(
            f"{url}: cache format version {quoted(version)} is not supported by this dflash "
            f"(reads versions {', '.join(map(str, READ_VERSIONS))}); rebuild the cache or install a matching dflash"
        )
    if version != 1:
        return _check_header(manifest, url, ("teacher", "layer_ids", "hidden_size", "hidden_dtype", "top_k"))
    _check_header(manifest, url, ("teacher", "layer_ids", "hidden_size", "hidden_dtype", "top_k", "shards"))
    for position, record in enumerate(manifest["shards"]):
        missing = [f for f in SHARD_RECORD_FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise CacheError(f"{url}: manifest.json shard entry {position} lacks {missing[0]!r}; the cache is damaged, "
                             "rebuild it (or restore manifest.json)")
        problem = record_shape_problem(record, manifest)
        if problem:
            raise CacheError(f"{url}: manifest.json shard entry {position} {problem}; the manifest is damaged or edited: "
                             "rebuild the cache (or restore manifest.json)")
    return manifest


def _check_header(manifest: dict, url: str, required: tuple[str, ...]) -> dict:
    """The fields every version shares: present, of their types, within bounds."""
    for key in required:
        if key not in manifest:
            raise CacheError(f"{url}: manifest.json lacks the field {key!r}; the cache is damaged, rebuild it")
    expected = {"teacher": (dict, "an object"), "layer_ids": (list, "a list of layer ids"), "shards": (list, "a list"),
                "hidden_size": (int, "a whole number"), "top_k": (int, "a whole number")}
    for key, (kind, what) in expected.items():
        if key not in required:
            continue
        value = manifest[key]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
            raise CacheError(f"{url}: manifest.json field {key!r} is {quoted(value)}, not {what}; the cache is damaged, "
                             "rebuild it")
    for key, bound in (("top_k", MAX_TOP_K), ("hidden_size", MAX_HIDDEN_SIZE)):
        if manifest[key] > bound:
            raise CacheError(f"{url}: manifest.json field {key!r} is {manifest[key]:,}, above any model's ({bound:,} at "
                             "most); the manifest is damaged or edited: rebuild the cache (or restore manifest.json)")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in manifest["layer_ids"]):
        raise CacheError(f"{url}: manifest.json layer_ids {quoted(manifest['layer_ids'])} are not layer numbers; rebuild the cache")
    if not isinstance(manifest["hidden_dtype"], str) or manifest["hidden_dtype"] not in HIDDEN_STORAGE:
        raise CacheError(f"{url}: unknown hidden dtype {quoted(manifest['hidden_dtype'])} in manifest.json")
    if hidden_format_of(manifest) not in HIDDEN_FORMATS:
        raise CacheError(f"{url}: unknown hidden_format {quoted(manifest['hidden_format'])} in manifest.json "
                         f"(this dflash reads {', '.join(HIDDEN_FORMATS)}); install a dflash that writes it")
    return manifest


def record_shape_problem(record: dict, manifest: dict) -> str | None:
    """What makes a shard record disagree with its manifest's sizes (None when nothing does): its
    counts must be whole numbers and its hidden_shape [tokens, tapped layers, hidden_size], the
    shape its Zarr array is checked against before a reader uses it."""
    for key in ("sequences", "tokens"):
        value = record[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return f"has {key} = {quoted(value)}, not a count"
    shape = record.get("hidden_shape")
    expected = [record["tokens"], len(manifest["layer_ids"]), manifest["hidden_size"]]
    if shape is not None and shape != expected:
        return (f"has hidden_shape {quoted(shape)}, not [tokens, tapped layers, hidden_size] = {expected} of the manifest's "
                "top-level fields")
    return None


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


def read_manifest(fs, root: str, url: str | None = None) -> dict:
    path = join(root, MANIFEST)
    with reaching(url or root):
        exists = fs.exists(path)
    if not exists:
        raise CacheError(f"{url or root}: no manifest.json; not a dflash cache (build one with `dflash-cache build`)")
    with reaching(url or root):
        manifest = read_json(fs, path, f"{url or root}: manifest.json")
    return check_manifest(manifest, url or root)


def manifest_header(layer_ids, hidden_size: int, hidden_dtype: str, top_k: int, hidden_format: str = LOSSLESS,
                    teacher: dict | None = None, tokenizer: dict | None = None, format_version: int = FORMAT_VERSION,
                    **provenance: Any) -> dict:
    """A manifest's fields apart from its shards: what the arrays of every shard are (tapped layers,
    width, dtype and storage, k), the teacher, and what a build adds of its provenance (corpus,
    content options, build config). The one place these fields are put together: builds,
    benchmarks and tests all make manifests through it and write_manifest."""
    return {"format": FORMAT_NAME, "format_version": int(format_version), "complete": False, "teacher": teacher or {},
            **({"tokenizer": tokenizer} if tokenizer is not None else {}),
            "layer_ids": list(layer_ids), "hidden_size": int(hidden_size), "hidden_dtype": hidden_dtype,
            "hidden_format": hidden_format, "hidden_storage": stored_dtype(hidden_dtype, hidden_format).name,
            "top_k": int(top_k), "topk_ids_dtype": "int32", "topk_logprobs_dtype": "float32", **provenance}


def write_manifest(fs, root: str, header: dict, records: list[dict], complete: bool, fault_point: str | None = None,
                   **extra: Any) -> dict:
    """Write manifest.json over these shard records (atomically: index written last) and return it.
    Format 1 lists the records in it; format 2 gives the totals and (``extra``) its ``index``, and
    the dict returned also holds the records under ``shards`` for the caller (the file does not)."""
    if header.get("format_version", FORMAT_VERSION) == 1:
        manifest = dict(header, complete=complete, totals=totals(records), shards=records, **extra)
    else:
        if "index" not in extra and records:  # a cache put together by hand (benchmarks, tests): index its shards
            from dflash_cache import index

            extra = dict(extra, index=index.index_records(fs, root, records))
        manifest = dict(header, complete=complete, totals=totals(records), **extra)
        write_json_atomic(fs, join(root, MANIFEST), manifest, fault_point=fault_point)
        return dict(manifest, shards=records)
    write_json_atomic(fs, join(root, MANIFEST), manifest, fault_point=fault_point)
    return manifest


def totals(shards: list[dict]) -> dict[str, int]:
    """Sum of the per-shard counters."""
    keys = ("sequences", "tokens", "loss_tokens", "bytes")
    out = {k: sum(int(s[k]) for s in shards) for k in keys}
    skipped: dict[str, int] = {}
    for s in shards:
        for reason, n in s.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + int(n)
    out["skipped"] = skipped
    out["shards"] = len(shards)
    return out


def check_shard_paths(record: Any, url: str, source: str = MANIFEST) -> dict:
    """Refuse a shard record (from manifest.json or a commit record) whose paths could leave the
    cache: the shard name must be a plain ``shard-rRRRRR-IIIIII`` (see `shard_name`) and every file
    it lists a relative path inside the shard, with no ``..``, absolute path, URL scheme, empty
    part or backslash. The one check of untrusted names; the reader and verify call it before any
    name becomes a path."""
    import re

    def problem(path: Any, shard: bool) -> str | None:
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

    what = "the manifest" if source == MANIFEST else f"the commit record {source}"
    fix = (f"{what} is not trustworthy (edited or damaged): rebuild the cache with `dflash-cache build ... "
           f"--overwrite`, or restore or fix {source}")
    if not isinstance(record, dict):
        raise CacheError(f"{url}: {source} lists a shard that is a {type(record).__name__}, not a record; {fix}")
    name = record.get("name")
    bad = problem(name, shard=True)
    if bad:
        raise CacheError(f"{url}: {source} names a shard {quoted(name)}, which {bad}; {fix}")
    files = record.get("files", {})
    for path in files if isinstance(files, dict) else [files]:
        bad = problem(path, shard=False) if isinstance(files, dict) else "is not a table of files"
        if bad:
            raise CacheError(f"{url}: {source} lists a file {quoted(path)} of shard {name}, which {bad}; {fix}")
    return record
