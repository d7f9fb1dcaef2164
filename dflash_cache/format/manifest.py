"""manifest.json: the header every shard's arrays follow (tapped layers, width, dtype, storage,
top-k), the teacher's identity and head record, the build's provenance, and the totals. Read and
checked here; what a version adds to it (format 1: every shard's commit record; format 2: a
pointer to the index) is dflash_cache.format.versions'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_cache.format.hidden import HIDDEN_STORAGE, stored_dtype
from dflash_cache.settings.storage_config import HIDDEN_FORMATS, LOSSLESS
from dflash_common.errors import CacheError, quoted

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 2
"""What a new build writes."""
READ_VERSIONS = (1, 2)
"""What the reader reads. A build over a format-1 cache resumes it as format 1."""


def hidden_format_of(manifest: dict) -> str:
    """The manifest's hidden_format; caches written before fp8 existed are lossless."""
    return manifest.get("hidden_format") or LOSSLESS


# Fields of a shard record that readers use; a record without one is damaged.
SHARD_RECORD_FIELDS = ("name", "sequences", "tokens", "bytes", "files", "checksums")
# Bounds on the manifest's sizes, far above any model's (vocabularies reach 262,144 tokens, hidden
# sizes 25,600): a reader allocates by them before it reads a shard, so an edited manifest's 10**9
# would end in an allocation failure rather than a refusal.
MAX_TOP_K = 2**20
MAX_HIDDEN_SIZE = 2**17


def check_manifest(manifest: dict, url: str) -> int:
    """Refuse manifests this code cannot read, naming the fix: not a dflash manifest, a version it
    does not read, a header field missing, of another type or out of bounds. Returns the version
    (what it adds to the manifest is checked by its layout: dflash_cache.format.versions)."""
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
    check_fields(manifest, url, ("teacher", "layer_ids", "hidden_size", "hidden_dtype", "top_k"))
    return version


def check_fields(manifest: dict, url: str, required: tuple[str, ...]) -> dict:
    """The ``required`` fields of the manifest: present, of their types, within bounds."""
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
        if key in required and manifest[key] > bound:
            raise CacheError(f"{url}: manifest.json field {key!r} is {manifest[key]:,}, above any model's ({bound:,} at "
                             "most); the manifest is damaged or edited: rebuild the cache (or restore manifest.json)")
    if "layer_ids" not in required:
        return manifest
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in manifest["layer_ids"]):
        raise CacheError(f"{url}: manifest.json layer_ids {quoted(manifest['layer_ids'])} are not layer numbers; rebuild the cache")
    if not isinstance(manifest["hidden_dtype"], str) or manifest["hidden_dtype"] not in HIDDEN_STORAGE:
        raise CacheError(f"{url}: unknown hidden dtype {quoted(manifest['hidden_dtype'])} in manifest.json")
    if hidden_format_of(manifest) not in HIDDEN_FORMATS:
        raise CacheError(f"{url}: unknown hidden_format {quoted(manifest['hidden_format'])} in manifest.json "
                         f"(this dflash reads {', '.join(HIDDEN_FORMATS)}); install a dflash that writes it")
    return manifest


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What `info` describes of a manifest beyond its header: the teacher's identity fields (the name
# required, the rest of their type when present) and the totals (optional: the reader sums them
# from the index when absent). A field of another type is a damaged or edited manifest.
TEACHER_FIELD_TYPES = {"name": (str, "a name"), "revision": ((str, type(None)), "a revision or null"),
                       "model_type": (str, "a model type"), "num_hidden_layers": (int, "a count"),
                       "hidden_size": (int, "a count"), "vocab_size": (int, "a count"),
                       "config_hash": (str, "a hash"), "weights_hash": (str, "a hash"),
                       "weights_hash_of": (str, "a hash's source")}
TOTALS_COUNTS = ("sequences", "tokens", "loss_tokens", "bytes", "shards")


def described_field_problems(manifest: dict) -> list[str]:
    """What is wrong with the fields ``info`` describes (the teacher's identity, the totals,
    ``complete``), each as "field X is V, not W"; empty when nothing is. The header's own fields
    are check_manifest's."""
    problems = []
    teacher = manifest.get("teacher")
    if isinstance(teacher, dict):
        if "name" not in teacher:
            problems.append("field 'teacher.name' is missing (the teacher's name)")
        for key, (kind, what) in TEACHER_FIELD_TYPES.items():
            if key in teacher and not (isinstance(teacher[key], kind) and not isinstance(teacher[key], bool)
                                       and (kind is not int or teacher[key] >= 0)):
                problems.append(f"field 'teacher.{key}' is {quoted(teacher[key])}, not {what}")
    if "complete" in manifest and not isinstance(manifest["complete"], bool):
        problems.append(f"field 'complete' is {quoted(manifest['complete'])}, not true or false")
    totals = manifest.get("totals")
    if "totals" in manifest and not isinstance(totals, dict):
        problems.append(f"field 'totals' is {quoted(totals)}, not an object")
    elif isinstance(totals, dict):
        problems += [f"field 'totals.{key}' is {quoted(totals[key])}, not a count"
                     for key in TOTALS_COUNTS if key in totals and not _is_count(totals[key])]
        skipped = totals.get("skipped", {})
        if not isinstance(skipped, dict) or not all(isinstance(k, str) and _is_count(n) for k, n in skipped.items()):
            problems.append(f"field 'totals.skipped' is {quoted(skipped)}, not counts by reason")
    return problems


def _whole_at_least_1(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number_in(low: float, high: float):
    return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


# Every field of an existing manifest a build's resume (or finalize) reads for a value, beyond the
# fields it only compares whole with this build's (build.output.RESUME_KEYS: any JSON value
# compares): its path, what it must be, and the test. An absent field takes the build's default;
# an object's fields are checked only once the object itself is one.
RESUMED_FIELDS = (
    (("teacher",), "an object", lambda v: isinstance(v, dict)),
    (("content_options",), "an object", lambda v: isinstance(v, dict)),
    (("content_options", "shards_per_generate"), "a whole number >= 1", _whole_at_least_1),
    (("content_options", "world_size"), "a whole number >= 1", _whole_at_least_1),
    (("build",), "an object", lambda v: isinstance(v, dict)),
    (("build", "vllm"), "an object", lambda v: isinstance(v, dict)),
    (("build", "vllm", "generate_tokens"), "a whole number >= 1 or null", lambda v: v is None or _whole_at_least_1(v)),
    (("teacher_head",), "an object", lambda v: isinstance(v, dict)),
    (("last_run",), "an object", lambda v: isinstance(v, dict)),
    (("last_run", "padding_fraction"), "a number in [0, 1]", _number_in(0.0, 1.0)),
)


def resumed_field_problem(manifest: dict) -> str | None:
    """The first of RESUMED_FIELDS that ``manifest`` holds and that is not what a resume can use,
    said as "field 'a.b' is V, not W"; None when every one is usable."""
    for path, what, usable in RESUMED_FIELDS:
        value: Any = manifest
        for key in path:
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            if not usable(value):
                return f"field {'.'.join(path)!r} is {quoted(value)}, not {what}"
    return None


def check_resumed_fields(manifest: dict, url: str) -> None:
    """Refuse, naming the field, a manifest a build would resume from (or finalize) whose fields it
    reads are edited or damaged (resumed_field_problem), before anything is written."""
    problem = resumed_field_problem(manifest)
    if problem:
        raise CacheError(f"{url}: manifest.json {problem}; the manifest was edited or damaged and a resume reads it, so "
                         "nothing was written: restore manifest.json, or rebuild the cache with --overwrite")


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


@dataclass(frozen=True)
class ArraySpec:
    """What the arrays of every shard of a cache are, from its manifest's header: what a reader
    and the integrity checks judge a shard's files against."""

    layer_ids: tuple[int, ...]
    hidden_size: int
    hidden_dtype: str
    hidden_format: str
    top_k: int

    @classmethod
    def of(cls, manifest: dict) -> "ArraySpec":
        return cls(tuple(manifest["layer_ids"]), int(manifest["hidden_size"]), manifest["hidden_dtype"],
                   hidden_format_of(manifest), int(manifest["top_k"]))

    @property
    def stored_dtype(self):
        return stored_dtype(self.hidden_dtype, self.hidden_format)

    @property
    def scale_layers(self) -> int:
        """Layers of scale exponents per token in tokens.arrow (0: the hidden states are lossless)."""
        return len(self.layer_ids) if self.hidden_format != LOSSLESS else 0
