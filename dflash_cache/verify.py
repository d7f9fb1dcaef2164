"""`dflash-cache verify`: checksums, shapes, dtypes and finiteness of every committed shard."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_cache import format as fmt
from dflash_cache import health
from dflash_cache.format import fp8
from dflash_cache.format.hidden import HiddenChecksumError, ShardedHidden
from dflash_cache.format.integrity import (
    HASH_WINDOW,
    RECORD,
    ShardIntegrityError,
    error_problem,
    problem_text,
    record_problems,
    refuse_outside_links,
    size_problems,
)
from dflash_cache.format.teacher_folder import FIX as TEACHER_FIX
from dflash_cache.format.teacher_folder import teacher_file_problems
from dflash_cache.reader import Cache
from dflash_cache.shard import Shard
from dflash_common.errors import CacheError, shown
from dflash_common.progress import Progress


@dataclass
class VerifyReport:
    """What verify found: one entry per bad shard, plus leftovers that are not part of the cache."""

    shards_checked: int = 0
    bad_shards: dict[str, list[str]] = field(default_factory=dict)
    uncommitted: list[str] = field(default_factory=list)
    head_problem: str | None = None
    """What is wrong with teacher/head.safetensors (Cache.load_teacher_head's refusal), or None."""
    head_note: str | None = None
    """What verify could not check of the head and why (a cache built before its checksum was
    recorded; a build that has not written it yet), or None."""

    teacher_problems: list[str] = field(default_factory=list)
    """What is wrong with the files of teacher/ (format.teacher_folder.teacher_file_problems)."""

    layers: list[dict] = field(default_factory=list)
    """Capture health per tapped layer over the cache (dflash_cache.health.summary)."""
    health_flags: list[str] = field(default_factory=list)
    """Layers (or shards' layers) whose capture health is far from the rest."""

    @property
    def ok(self) -> bool:
        return not self.bad_shards and self.head_problem is None and not self.health_flags and not self.teacher_problems


def _nonfinite_bf16(bits: np.ndarray) -> int:
    """Count NaN/Inf in bf16 stored as uint16: all exponent bits set."""
    return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))


def _nonfinite_stored(stored: np.ndarray, hidden_dtype: str, hidden_format: str) -> int:
    """Count stored hidden values that decode to NaN/Inf."""
    if hidden_format == fp8.FORMAT:
        return int(np.count_nonzero((stored & fp8.NAN_MASK) == fp8.NAN_MASK))
    if hidden_dtype == "bfloat16":
        return _nonfinite_bf16(stored)
    return int((~np.isfinite(stored)).sum())


def scale_problems(tokens, n_layers: int) -> list[str]:
    """The fp8 scale-exponent column of a token table: present, one per layer, in range."""
    if fmt.SCALE_COLUMN not in tokens.column_names:
        return [f"tokens.arrow lacks the {fmt.SCALE_COLUMN} column of an fp8 cache"]
    column = tokens.column(fmt.SCALE_COLUMN).combine_chunks()
    if column.type != fmt.tokens_schema(1, n_layers).field(fmt.SCALE_COLUMN).type:
        return [f"{fmt.SCALE_COLUMN} has type {column.type}, expected {n_layers} int8 per token"]
    exponents = column.values.to_numpy()
    outside = int(np.count_nonzero((exponents < fp8.MIN_EXP) | (exponents > fp8.MAX_EXP)))
    if outside:
        return [f"{outside} fp8 scale exponents lie outside [{fp8.MIN_EXP}, {fp8.MAX_EXP}]"]
    return []


MAX_PROBLEMS = 5
"""Problems listed per bad shard (verify names the count of the rest); each at most
integrity.PROBLEM_CHARS characters, so one BAD line stays under a kilobyte."""
MAX_NAMED = 20
"""Bad shards, leftovers and re-run mismatches verify names one line each; one more line counts
the rest (100,000 damaged shards are 21 lines, not 100,000)."""


def short(problems: list[str]) -> list[str]:
    """At most MAX_PROBLEMS problems, each cut to one short line: one BAD line stays readable."""
    kept = [problem_text(p) for p in problems[:MAX_PROBLEMS]]
    return kept + ([f"+{len(problems) - MAX_PROBLEMS} more"] if len(problems) > MAX_PROBLEMS else [])


def report_lines(report: "VerifyReport") -> list[str]:
    """What verify prints of the shards (to stderr): leftovers as notes, then damaged shards as
    BAD lines, each kind named for the first MAX_NAMED and counted after that. Every line is
    under a kilobyte however many shards are damaged or how long a name in the cache is."""
    lines = [f"note: {shown(name)} is not listed in the manifest (left by an interrupted build; rerun the build to "
             "finish it)" for name in report.uncommitted[:MAX_NAMED]]
    if len(report.uncommitted) > MAX_NAMED:
        lines.append(f"note: and {len(report.uncommitted) - MAX_NAMED:,} more entries of {fmt.SHARDS_DIR}/ are not "
                     "listed in the manifest")
    for name, problems in itertools.islice(report.bad_shards.items(), MAX_NAMED):
        lines.append(f"BAD {shown(name)}: {'; '.join(short(problems))}")
    if len(report.bad_shards) > MAX_NAMED:
        lines.append(f"BAD and {len(report.bad_shards) - MAX_NAMED:,} more shard(s) (only the first {MAX_NAMED} are "
                     "named)")
    return lines


def health_lines(layers: list[dict], flags: list[str]) -> list[str]:
    """The capture health of a cache, a line per tapped layer and per flag (info and verify)."""
    return [f"layer {layer['layer']}: RMS {layer['rms']:.4g}, zeros {layer['zero_fraction']:.2%}, "
            f"NaN/Inf {layer['nonfinite']:,}" for layer in layers] + [f"FLAG capture health: {flag}" for flag in flags]


def finding_lines(report: "VerifyReport", damaged: str | None = None) -> list[str]:
    """Everything verify prints to stderr of what it found before its verdict: the shards
    (``report_lines``), where the full list of damaged shards went (``damaged``), the teacher
    head, the capture health and what could not be checked."""
    lines = report_lines(report)
    if damaged is not None and report.bad_shards:
        lines.append(f"note: the {len(report.bad_shards):,} damaged shards' names are in {shown(damaged)}; train "
                     f"without them with --skip-shards \"$(cat {shown(damaged)})\"")
    if report.head_problem:
        lines.append(f"BAD teacher head: {report.head_problem}")
    lines += [f"BAD teacher file: {problem}" for problem in report.teacher_problems[:MAX_NAMED]]
    if len(report.teacher_problems) > MAX_NAMED:
        lines.append(f"BAD and {len(report.teacher_problems) - MAX_NAMED:,} more teacher file problem(s)")
    lines += health_lines(report.layers, report.health_flags)
    if report.head_note:
        lines.append(f"note: {report.head_note}")
    return lines


def verdict(cache: Cache, report: "VerifyReport", deep=None) -> tuple[int, str]:
    """verify's exit code and last line: 1 with what to do when the shards, the teacher head, the
    capture health or the ``deep`` re-run (a DeepReport) condemn the cache, else 0 and what passed."""
    rebuild = "rebuild the cache with `dflash-cache build ... --overwrite`"
    if report.head_problem and not report.bad_shards:
        return 1, f"error: the teacher head is damaged; {rebuild}"
    if report.teacher_problems and not report.bad_shards:
        return 1, (f"error: {len(report.teacher_problems)} of the teacher's files cannot be read safely (see BAD above); "
                   f"{TEACHER_FIX}")
    if report.health_flags and not report.bad_shards and not report.head_problem and not report.teacher_problems:
        return 1, ("error: the capture health of this cache is flagged (see FLAG above): its hidden states look broken; "
                   "check the teacher and rebuild with `dflash-cache build ... --overwrite`")
    if not report.ok:
        head = " and so is the teacher head" if report.head_problem else ""
        return 1, f"error: {len(report.bad_shards)} of {report.shards_checked} shard(s) are damaged{head}; {rebuild}"
    if deep is not None and not deep.ok:
        return 1, (f"error: {len(deep.mismatches)} of {deep.checked} re-run sequences differ from what {deep.teacher} "
                   f"computes now; the cache does not hold this teacher's outputs, rebuild it with "
                   "`dflash-cache build ... --overwrite`")
    state = "complete" if cache.complete else "incomplete (build not finished)"
    passed = f"ok: {report.shards_checked} shard(s), {len(cache):,} sequences verified; cache {state}"
    if deep is not None:
        passed = f"deep: {deep.checked} sequences re-run with {deep.teacher} match the stored values\n{passed}"
    return 0, passed


def check_shard(cache: Cache, shard) -> list[str]:
    """Problems of one shard (empty when it is intact): a ``Shard`` of ``cache``. Its record comes
    from the cache's manifest or index, whose names the reader checked when it opened the cache;
    the commit record on disk is checked the same way before it is compared, and a symlink in the
    shard that leaves the cache is refused (CacheError), not reported as damage. Nothing here
    looks at another shard or lists more than this shard's folder: verify's time is linear in
    the shard count (a lookup of the shard by name among all of them made it quadratic)."""
    fs, record = cache.fs, shard.record
    fmt.check_shard_paths(record, cache.url)
    shard_dir = shard.path
    problems = record_problems(shard.files, RECORD)
    if not fs.exists(shard_dir):
        return problems + ["shard folder missing"]
    refuse_outside_links(cache.store, shard_dir)
    found = {p[len(shard_dir) + 1:]: int(i["size"]) for p, i in fs.find(shard_dir, detail=True).items()}
    problems += size_problems(record["files"], found)
    if problems:
        return problems

    for name in (fmt.TOKENS, fmt.SEQUENCES):
        data = fs.cat_file(fmt.join(shard_dir, name))
        if fmt.checksum(data) != record["checksums"][name]:
            problems.append(f"{name} checksum mismatch")
    if problems:
        return problems
    # the same checks of the counts as the training loader's
    problems += record_problems(shard.files, fmt.SEQUENCES) + record_problems(shard.files, fmt.TOKENS)
    problems = problems or _index_rows_problems(shard)
    if problems:
        return problems
    try:
        tokens = cache.store.open_ipc(fmt.join(shard_dir, fmt.TOKENS))
        logprobs = tokens.column("topk_logprobs").combine_chunks().values.to_numpy()
        if not np.isfinite(logprobs).all():
            problems.append("top-k log-probs contain NaN/Inf")
        if cache.hidden_format == fp8.FORMAT:
            problems += scale_problems(tokens, len(cache.layer_ids))
        array = shard.hidden_array
        expected_shape = tuple(record["hidden_shape"])
        if tuple(array.shape) != expected_shape:
            problems.append(f"hidden shape {tuple(array.shape)} differs from {expected_shape}")
        elif array.dtype != (expected_dtype := fmt.stored_dtype(cache.hidden_dtype, cache.hidden_format)):
            problems.append(f"hidden dtype {array.dtype} differs from {expected_dtype}, the storage of the manifest's "
                            f"{cache.hidden_dtype} ({cache.hidden_format})")
        else:
            digest, bad, max_abs = _read_all_hidden(shard, array)
            if digest != record["checksums"]["hidden"]:
                problems.append("hidden states checksum mismatch")
            if bad:
                problems.append(f"hidden states contain {bad} NaN/Inf values")
            if max_abs is not None:  # no model's states: the build refuses them, a cache from elsewhere may hold them
                problems += [f"hidden states: {p}" for p in health.magnitude_problems(max_abs, cache.layer_ids)]
    except ShardIntegrityError as err:
        problems += err.problems
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        problems.append(error_problem(err))
    return problems


def _index_rows_problems(shard) -> list[str]:
    """The shard's sequences.arrow against the sequences the reader hands out (format 2: its rows of
    the index's sequence table; format 1: the file itself, so nothing can differ)."""
    table = shard.cache.store.open_ipc(fmt.join(shard.path, fmt.SEQUENCES))
    if table.column("id").to_pylist() != shard.ids:
        return ["sequence ids differ from the index"]
    if not (np.array_equal(table.column("length").to_numpy(), shard.lengths)
            and np.array_equal(table.column("offset").to_numpy(), shard.offsets)):
        return ["sequence lengths or offsets differ from the index"]
    return []


def _read_all_hidden(shard, array) -> tuple[str, int, np.ndarray | None]:
    """xxh64 of the whole stored array, its NaN/Inf count and (lossless storage) each tapped layer's
    largest finite |x| over every value (health.exact_counts, from the bits; fp8's values need their
    per-token scales: None), read a window at a time; format 2 checks every inner chunk's crc32c on
    the way (ShardIntegrityError names a bad one)."""
    import xxhash

    cache = shard.cache
    digest, bad = xxhash.xxh64(), 0
    lossless = cache.hidden_format != fp8.FORMAT
    largest = np.zeros(len(cache.layer_ids)) if lossless else None

    def count(stored: np.ndarray) -> None:
        nonlocal bad, largest
        if not lossless:
            bad += _nonfinite_stored(stored, cache.hidden_dtype, cache.hidden_format)
            return
        values = fmt.from_storage(stored.reshape(-1, *array.shape[1:]), cache.hidden_dtype)
        _, nonfinite, max_abs = health.exact_counts(values)
        bad += int(nonfinite.sum())
        largest = np.maximum(largest, max_abs)

    files = shard.files.fast_hidden
    if isinstance(files, ShardedHidden):
        try:
            for rows in files.check_all():
                digest.update(rows)
                count(rows.view(files.dtype))
        except HiddenChecksumError as err:
            raise ShardIntegrityError(cache.url, shard.name, [f"hidden states: {err.problem}"]) from None
        return digest.hexdigest(), bad, largest
    n = array.shape[0]
    step = max(1, HASH_WINDOW // max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize))
    for lo in range(0, n, step):
        stored = np.ascontiguousarray(shard.read_stored(lo, min(n, lo + step)))
        digest.update(stored.view(np.uint8).reshape(-1))
        count(stored)
    return digest.hexdigest(), bad, largest


def _each_shard_once(cache: Cache) -> Iterator[Shard]:
    """Every shard of ``cache`` in order, each a Shard of its own that is dropped once checked:
    ``cache.shards`` keeps the shards it made (and, in them, a map of each hidden-state file and
    each opened array), and a verify that kept 100,000 shards' maps would pass the kernel's
    65,530 maps a process and call every shard after that unreadable."""
    return (Shard(cache, j) for j in range(len(cache.shards)))


def verify_cache(cache: Cache, progress: Progress | None = None) -> VerifyReport:
    progress = progress or Progress()
    report = VerifyReport()
    progress.start(len(cache.shards), "verifying", "shard")
    for shard in _each_shard_once(cache):
        problems = check_shard(cache, shard)
        if problems:
            report.bad_shards[shard.name] = short(problems)
        report.shards_checked += 1
        progress.advance(1)
    progress.close()
    if not cache.complete and not cache.fs.exists(cache.teacher_path(fmt.TEACHER_HEAD)):
        # a build stopped before writing it (a full disk, say): its rerun writes it
        report.head_note = (f"{fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD} is not written yet (the build has not finished; "
                            "its rerun writes it)")
    else:
        try:  # the same checks as every reader of the head (checksum, dtype, finiteness)
            cache.teacher_head_bytes()
        except CacheError as err:
            report.head_problem = str(err)
        if not report.head_problem and not fmt.teacher_head_checked(cache.manifest):
            report.head_note = (f"{fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD} was not compared with a checksum: this cache was "
                                "built before dflash recorded one (its dtypes and values were checked)")
    report.teacher_problems = teacher_file_problems(cache.store)
    report.layers, report.health_flags = cache.capture_health()
    report.uncommitted = _leftovers(cache)
    return report


def _leftovers(cache: Cache) -> list[str]:
    """Entries of the shard folders that are neither a listed shard nor its commit record."""
    listed, found = set(cache.shard_names()), []
    for folder in cache.layout.shard_folders(cache.store):
        if cache.fs.exists(folder):
            for path in cache.fs.ls(folder, detail=False):
                name = path.rstrip("/").rsplit("/", 1)[-1]
                if not name.endswith(".json") and name not in listed and name not in cache.layout.ignored_entries:
                    found.append(name)
    return found
