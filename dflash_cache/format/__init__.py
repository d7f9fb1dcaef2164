"""The cache format, one module per part, importable without torch or transformers:

- ``cache_layout``: file and folder names, shard names and paths, the untrusted-path check, checksums
- ``store``: ``CacheStore``, the only code that touches storage (atomic writes, bounded reads, maps)
- ``manifest``: the header, its checks and totals
- ``teacher_head``: teacher/head.safetensors's record and checks
- ``teacher_folder``: the checks of every file of teacher/ before any is read
- ``hidden``: hidden states encoded and decoded (dtypes, fp8, the format-2 Zarr shard object)
- ``token_tables``: tokens.arrow and sequences.arrow encoded and decoded
- ``fp8``: the fp8 e4m3 codec
- ``index``: format 2's shard and sequence tables
- ``record``: a committed shard's files and commit record
- ``integrity``: whether a shard holds what its record says
- ``v1``, ``v2`` and ``versions``: what differs between format versions, and the one switch

The names below are the format's public face: ``from dflash_cache import format as fmt`` then
``fmt.TOKENS``, ``fmt.read_manifest(...)``.
"""

from dflash_cache.format.cache_layout import (
    HIDDEN,
    HIDDEN_DATA,
    HIDDEN_META,
    INDEX_DIR,
    MANIFEST,
    SEQUENCE_TABLE,
    SEQUENCES,
    SHARD_NAME,
    SHARD_TABLE,
    SHARDS_DIR,
    TEACHER_DIR,
    TEACHER_HEAD,
    TOKENS,
    V2_FILES,
    check_shard_paths,
    checksum,
    join,
    rank_folder,
    rank_of,
    shard_name,
)
from dflash_cache.format.hidden import (
    HIDDEN_NUMPY,
    HIDDEN_STORAGE,
    decode_hidden,
    from_storage,
    hidden_bytes_per_token,
    stored_dtype,
)
from dflash_cache.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_HIDDEN_SIZE,
    MAX_TOP_K,
    READ_VERSIONS,
    SHARD_RECORD_FIELDS,
    ArraySpec,
    check_resumed_fields,
    described_field_problems,
    hidden_format_of,
    manifest_header,
    record_shape_problem,
    totals,
)
from dflash_cache.format.store import (
    CacheStore,
    is_local,
    reaching,
    read_json,
    url_to_fs,
    write_bytes_atomic,
    write_json_atomic,
)
from dflash_cache.format.teacher_head import (
    TEACHER_HEAD_DTYPES,
    TEACHER_HEAD_TENSORS,
    head_tensor_problem,
    teacher_head_checked,
    teacher_head_problem,
    teacher_head_record,
)
from dflash_cache.format.token_tables import SCALE_COLUMN, sequences_schema, token_bytes_per_token, tokens_schema
from dflash_cache.format.versions import layout_for, read_manifest, shard_path, write_manifest
from dflash_cache.settings.storage_config import LOSSLESS

__all__ = [
    "HIDDEN_NUMPY", "HIDDEN_STORAGE", "decode_hidden", "from_storage", "hidden_bytes_per_token", "stored_dtype",
    "HIDDEN", "HIDDEN_DATA", "HIDDEN_META", "INDEX_DIR", "MANIFEST", "SEQUENCE_TABLE", "SEQUENCES", "SHARD_NAME",
    "SHARD_TABLE", "SHARDS_DIR", "TEACHER_DIR", "TEACHER_HEAD", "TOKENS", "V2_FILES", "check_shard_paths", "checksum",
    "join", "rank_folder", "rank_of", "shard_name", "FORMAT_NAME", "FORMAT_VERSION", "MAX_HIDDEN_SIZE", "MAX_TOP_K",
    "READ_VERSIONS", "SHARD_RECORD_FIELDS", "TEACHER_HEAD_DTYPES", "TEACHER_HEAD_TENSORS", "ArraySpec",
    "check_resumed_fields", "described_field_problems", "hidden_format_of", "manifest_header", "record_shape_problem",
    "teacher_head_checked", "teacher_head_problem", "teacher_head_record", "head_tensor_problem", "totals", "CacheStore", "is_local",
    "read_json", "reaching", "url_to_fs", "write_bytes_atomic", "write_json_atomic", "SCALE_COLUMN",
    "sequences_schema", "token_bytes_per_token", "tokens_schema", "layout_for", "read_manifest", "shard_path",
    "write_manifest", "LOSSLESS",
]
