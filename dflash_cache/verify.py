"""`dflash-cache verify`: checksums, shapes, dtypes and finiteness of every committed shard."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dflash_cache import format as fmt
from dflash_cache import fp8
from dflash_cache.integrity import (
    HASH_WINDOW,
    RECORD,
    ShardIntegrityError,
    error_problem,
    problem_text,
    record_problems,
    refuse_outside_links,
    size_problems,
)
from dflash_cache.reader import Cache, Shard
from dflash_cache.shard_files import open_ipc
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

    layers: list[dict] = field(default_factory=list)
    """Capture health per tapped layer over the cache (dflash_cache.health.summary)."""
    health_flags: list[str] = field(default_factory=list)
    """Layers (or shards' layers) whose capture health is far from the rest."""

    @property
    def ok(self) -> bool:
        return not self.bad_shards and self.head_problem is None and not self.health_flags


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
    problems = record_problems(shard, RECORD)
    if not fs.exists(shard_dir):
        return problems + ["shard folder missing"]
    refuse_outside_links(cache, shard_dir)
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
    problems += record_problems(shard, fmt.SEQUENCES) + record_problems(shard, fmt.TOKENS)
    if problems:
        return problems
    if cache.version != 1:
        problems += _index_rows_problems(shard)
        if problems:
            return problems
    try:
        tokens = open_ipc(fs, fmt.join(shard_dir, fmt.TOKENS))
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
            digest, bad = _read_all_hidden(shard, array)
            if digest != record["checksums"]["hidden"]:
                problems.append("hidden states checksum mismatch")
            if bad:
                problems.append(f"hidden states contain {bad} NaN/Inf values")
    except ShardIntegrityError as err:
        problems += err.problems
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        problems.append(error_problem(err))
    return problems


def _index_rows_problems(shard) -> list[str]:
    """Format 2: the shard's sequences.arrow against its rows of the index's sequence table."""
    table = open_ipc(shard.cache.fs, fmt.join(shard.path, fmt.SEQUENCES))
    if table.column("id").to_pylist() != shard.ids:
        return ["sequence ids differ from the index"]
    if not (np.array_equal(table.column("length").to_numpy(), shard.lengths)
            and np.array_equal(table.column("offset").to_numpy(), shard.offsets)):
        return ["sequence lengths or offsets differ from the index"]
    return []


def _read_all_hidden(shard, array) -> tuple[str, int]:
    """xxh64 of the whole stored array and its NaN/Inf count, read a window at a time; format 2
    checks every inner chunk's crc32c on the way (ShardIntegrityError names a bad one)."""
    import xxhash

    from dflash_cache.hidden_files import HiddenChecksumError, ShardedHidden

    cache = shard.cache
    digest, bad = xxhash.xxh64(), 0
    files = shard._chunk_files
    if isinstance(files, ShardedHidden):
        try:
            for rows in files.check_all():
                digest.update(rows)
                bad += _nonfinite_stored(rows.view(files.dtype), cache.hidden_dtype, cache.hidden_format)
        except HiddenChecksumError as err:
            raise ShardIntegrityError(cache.url, shard.name, [f"hidden states: {err.problem}"]) from None
        return digest.hexdigest(), bad
    n = array.shape[0]
    step = max(1, HASH_WINDOW // max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize))
    for lo in range(0, n, step):
        stored = np.ascontiguousarray(shard.read_stored(lo, min(n, lo + step)))
        digest.update(stored.view(np.uint8).reshape(-1))
        bad += _nonfinite_stored(stored, cache.hidden_dtype, cache.hidden_format)
    return digest.hexdigest(), bad


def _each_shard_once(cache: Cache) -> Iterator[Shard]:
    """Every shard of ``cache`` in order, each a Shard of its own that is dropped once checked:
    ``cache.shards`` keeps the shards it made (and, in them, a map of each hidden-state file and
    each opened array), and a verify that kept 100,000 shards' maps would pass the kernel's
    65,530 maps a process and call every shard after that unreadable."""
    if cache.version != 1:
        return (Shard(cache, position=j) for j in range(len(cache.shards)))
    return (Shard(cache, shard.record) for shard in cache.shards)


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
            cache.load_teacher_head()
        except CacheError as err:
            report.head_problem = str(err)
        if not report.head_problem and not fmt.teacher_head_checked(cache.manifest):
            report.head_note = (f"{fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD} was not compared with a checksum: this cache was "
                                "built before dflash recorded one (its dtypes and values were checked)")
    report.layers, report.health_flags = cache.capture_health()
    listed = set(cache.shard_names())
    shards_dir = fmt.join(cache.root, fmt.SHARDS_DIR)
    folders = [shards_dir]
    if cache.version != 1 and cache.fs.exists(shards_dir):  # one listing per rank folder: linear
        folders = [p for p in cache.fs.ls(shards_dir, detail=False) if re.fullmatch(r"r\d{5}", p.rstrip("/").rsplit("/", 1)[-1])]
    for folder in folders:
        if cache.fs.exists(folder):
            for path in cache.fs.ls(folder, detail=False):
                name = path.rstrip("/").rsplit("/", 1)[-1]
                if not name.endswith(".json") and name not in listed and (cache.version == 1 or name != ".tmp"):
                    report.uncommitted.append(name)
    return report


# --- verify --deep: re-run the teacher on a sample and compare --------------------------------

# Largest accepted difference, by the cache's dtype. Hidden states: |stored - fresh| relative to
# |fresh| plus the layer's RMS (so near-zero values and outlier features are both judged fairly).
# Log-probs: absolute, scaled by 1 + |log-prob|. float32 reruns differ only by summation order
# (~1e-6); bfloat16 reruns in other batches round differently by a few units of bf16's 2^-8
# relative precision, which grow a little through the layers. A cache holding another teacher's
# outputs, other layers or shifted positions is off by O(1), far above both.
DEEP_TOLERANCE = {"float32": {"hidden": 1e-4, "logprobs": 1e-4},
                  "bfloat16": {"hidden": 2 ** -4, "logprobs": 2 ** -4}}
# fp8 rounds each value to 4 significant bits: within 2^-4 of |value| on top of the rerun's own
# difference in the build dtype (log-probs are stored in float32 either way).
FP8_HIDDEN_TOLERANCE = {"float32": 2 ** -4 + 1e-4, "bfloat16": 2 ** -3}


@dataclass
class DeepReport:
    """What `verify --deep` found: the sequences whose stored values a fresh teacher run disowns."""

    teacher: str
    checked: int = 0
    mismatches: dict[str, str] = field(default_factory=dict)  # "id (shard)" -> what differs

    @property
    def ok(self) -> bool:
        return not self.mismatches


def mismatch_lines(report: DeepReport) -> list[str]:
    """What `verify --deep` prints of the sequences that differ: the first MAX_NAMED, then a count."""
    lines = [f"MISMATCH {shown(seq)}: {problem_text(problem)}"
             for seq, problem in itertools.islice(report.mismatches.items(), MAX_NAMED)]
    if len(report.mismatches) > MAX_NAMED:
        lines.append(f"MISMATCH and {len(report.mismatches) - MAX_NAMED:,} more sequence(s)")
    return lines


def deep_sample(sizes: list[int], n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Up to n (shard, sequence) pairs: a seeded round robin over shards, so any n >= number of
    shards reaches every shard (a shard rewritten wholesale is the likely corruption)."""
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(k) for k in sizes]
    shard_order = rng.permutation(len(sizes))
    picked: list[tuple[int, int]] = []
    depth = 0
    while len(picked) < n and depth < max(sizes, default=0):
        for s in shard_order:
            if depth < sizes[s] and len(picked) < n:
                picked.append((int(s), int(orders[s][depth])))
        depth += 1
    return picked


def hidden_error(stored: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """[n_layers] max over the sequence of |stored - fresh| / (|fresh| + RMS of the layer)."""
    a, b = np.asarray(stored, np.float32), np.asarray(fresh, np.float32)
    rms = np.sqrt(np.mean(np.square(b), axis=(0, 2), keepdims=True)) + 1e-12
    return (np.abs(a - b) / (np.abs(b) + rms)).max(axis=(0, 2)) if len(a) else np.zeros(a.shape[1])


def topk_mismatches(stored_ids: np.ndarray, stored_lp: np.ndarray, fresh_ids: np.ndarray, fresh_lp: np.ndarray,
                    tol: float) -> int:
    """Positions whose stored top-k disagrees with a fresh one beyond ``tol``. Near-ties may swap
    order or trade the k-th place, so: an id in both lists must have the same log-prob, and an id
    in only one list must lie within tol of the other list's k-th log-prob."""
    same = stored_ids[:, :, None] == fresh_ids[:, None, :]  # [T, k, k]
    allowed = lambda lp: tol * (1 + np.abs(lp))  # noqa: E731
    in_fresh, in_stored = same.any(2), same.any(1)
    fresh_at_stored = np.where(same, fresh_lp[:, None, :], 0).sum(2)
    bad = in_fresh & (np.abs(stored_lp - fresh_at_stored) > allowed(stored_lp))
    bad |= ~in_fresh & (stored_lp > fresh_lp[:, -1:] + allowed(fresh_lp[:, -1:]))
    bad_fresh = ~in_stored & (fresh_lp > stored_lp[:, -1:] + allowed(stored_lp[:, -1:]))
    return int((bad.any(1) | bad_fresh.any(1)).sum())


def deep_verify(cache: Cache, sample: int = 64, teacher: str | None = None, device: str = "auto",
                progress: Progress | None = None, skip: set[str] | frozenset[str] = frozenset()) -> DeepReport:
    """Re-run the teacher (the manifest's, or ``teacher``) on ``sample`` cached sequences and
    compare hidden states and top-k with what is stored. Checksums prove the bytes are the ones
    written; this proves they are the teacher's outputs for these tokens."""
    from dflash_common.errors import CacheError
    from dflash_teacher.teacher import TeacherConfig, identity_like, load_teacher, plan_batches

    progress = progress or Progress()
    built = (cache.manifest.get("build") or {}).get("teacher") or {}
    name = teacher or built.get("name_or_path") or cache.manifest["teacher"]["name"]
    cfg = TeacherConfig(name_or_path=name, revision=None if teacher else built.get("revision"),
                        dtype=cache.hidden_dtype, device=device, layers=tuple(cache.layer_ids), top_k=cache.top_k,
                        batch_tokens=int(built.get("batch_tokens", 8192)), logits_chunk=int(built.get("logits_chunk", 2048)))
    model = load_teacher(cfg)
    identity = identity_like(model, cache.manifest["teacher"])  # hashed as the cache's was
    for key in ("config_hash", "weights_hash"):
        expected = cache.manifest["teacher"].get(key)
        if expected and identity[key] != expected:
            raise CacheError(f"the teacher {name!r} is not the one {cache.url} was built with ({key} {identity[key]}, cache {expected}); pass --teacher with the original model")
    tol = dict(DEEP_TOLERANCE[cache.hidden_dtype])
    if cache.hidden_format == fp8.FORMAT:
        tol["hidden"] = FP8_HIDDEN_TOLERANCE[cache.hidden_dtype]
    sizes = [0 if s.name in skip else len(s) for s in cache.shards]
    refs = deep_sample(sizes, sample)
    report = DeepReport(teacher=name)
    records = [cache.shards[s][i] for s, i in refs]
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    progress.start(len(records), "re-running the teacher", "seq")
    for batch in plan_batches(lengths, cfg.batch_tokens) if len(records) else []:
        out = model.forward([records[j].input_ids for j in batch])
        pos = 0
        for j in batch:
            rec, n = records[j], int(lengths[j])
            fresh = fmt.from_storage(out.hidden[pos:pos + n], cache.hidden_dtype)
            problems = []
            errors = hidden_error(rec.hidden, fresh)
            for layer, err in zip(cache.layer_ids, errors):
                if not err <= tol["hidden"]:
                    problems.append(f"hidden states of layer {layer} differ by {err:.3g} (tolerance {tol['hidden']:.3g})")
            wrong = topk_mismatches(rec.topk_ids, rec.topk_logprobs, out.topk_ids[pos:pos + n],
                                    out.topk_logprobs[pos:pos + n], tol["logprobs"])
            if wrong:
                problems.append(f"top-k differs at {wrong} of {n} positions")
            if problems:
                report.mismatches[f"{rec.id} ({cache.shards[refs[j][0]].name})"] = "; ".join(problems)
            report.checked += 1
            pos += n
        progress.advance(len(batch))
    progress.close()
    return report
