"""Stage 1: corpus -> tokens -> teacher forward -> committed shards -> manifest.

The corpus is cut into shards by a deterministic rule (consecutive rows until the shard's token
budget is reached), so a build that is interrupted anywhere and rerun produces exactly the cache
an uninterrupted build would: committed shards are kept, everything else is redone.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from dflash_cache import format as fmt
from dflash_cache.corpus import (
    CorpusConfig,
    corpus_fingerprint,
    iter_rows,
    list_corpus_files,
    require_rows,
    tokenize_row,
)
from dflash_cache.settings.build import BuildConfig
from dflash_cache.teacher import (
    Teacher,
    load_config,
    load_teacher,
    load_tokenizer,
    resolve_layers,
    tokenizer_hashes,
)
from dflash_cache.writer import BackgroundWriter, ShardData, write_shard, write_teacher_files
from dflash_common.errors import BadRowError, CacheError
from dflash_common.files import one_writer
from dflash_common.progress import Progress
from dflash_common.resume_check import first_difference
from dflash_common.vllm_env import find_vllm_python

# Manifest fields that must match for a rerun to resume into an existing cache.
RESUME_KEYS = ("teacher", "tokenizer", "layer_ids", "top_k", "hidden_dtype", "hidden_format", "corpus", "content_options")


@dataclass
class DryRunEstimate:
    """What a build would write, from tokenizing the corpus without running the teacher."""

    rows: int
    sequences: int
    tokens: int
    loss_tokens: int
    skipped: dict[str, int]
    bytes_per_token: int
    bytes: int
    shards: int


def _content_options(cfg: BuildConfig) -> dict:
    c = cfg.corpus
    options = {"max_length": c.max_length, "overlong": c.overlong, "min_length": c.min_length,
               "shard_bytes": cfg.storage.shard_bytes, "world_size": cfg.world_size}
    if c.chat_template_kwargs:  # absent for caches built before it existed and for none given
        options["chat_template_kwargs"] = c.chat_template_kwargs
    return options


def _sequence_or_skip(row, tokenizer, cfg: CorpusConfig, seen: dict[str, int]):
    """A TokenizedSequence, or a skip reason; raises BadRowError for bad rows in fail mode."""
    try:
        if row.problem is not None:
            raise BadRowError(row.path, row.row, row.problem)
        result = tokenize_row(row, tokenizer, cfg)
        if not isinstance(result, str):
            first = seen.get(result.id)
            if first is not None:
                raise BadRowError(row.path, row.row, f"duplicate id {result.id!r} (first at corpus row {first + 1})")
            seen[result.id] = row.index
        return result
    except BadRowError:
        if cfg.on_bad_row == "fail":
            raise
        return "bad_row"


def estimate(cfg: BuildConfig, progress: Progress | None = None) -> DryRunEstimate:
    """Tokenize the whole corpus and size the cache, before any teacher work."""
    progress = progress or Progress()
    files = list_corpus_files(cfg.corpus.data)
    total_rows = require_rows(files, cfg.corpus.data)  # refused as the build refuses it, before the tokenizer loads
    tokenizer = load_tokenizer(cfg.teacher)
    teacher_config = load_config(cfg.teacher)
    layers = resolve_layers(cfg.teacher, int(teacher_config.num_hidden_layers), exact_count=True)
    per_token_hidden = fmt.hidden_bytes_per_token(len(layers), int(teacher_config.hidden_size), cfg.teacher.dtype,
                                                  cfg.storage.hidden_format)
    per_token = per_token_hidden + fmt.token_bytes_per_token(cfg.teacher.top_k)
    skipped: Counter = Counter()
    rows = sequences = tokens = loss_tokens = 0
    seen: dict[str, int] = {}
    progress.start(total_rows, "tokenizing", "rows")
    for row in iter_rows(cfg.corpus):
        rows += 1
        result = _sequence_or_skip(row, tokenizer, cfg.corpus, seen)
        if isinstance(result, str):
            skipped[result] += 1
        else:
            sequences += 1
            tokens += len(result.input_ids)
            loss_tokens += int(result.loss_mask.sum())
        progress.advance(1)
    progress.close()
    shard_tokens = max(1, cfg.storage.shard_bytes // per_token_hidden)
    return DryRunEstimate(
        rows=rows, sequences=sequences, tokens=tokens, loss_tokens=loss_tokens, skipped=dict(skipped),
        bytes_per_token=per_token, bytes=tokens * per_token, shards=max(1, math.ceil(tokens / shard_tokens)),
    )


def _header(cfg: BuildConfig, teacher: Teacher, files: list[str]) -> dict:
    return fmt.manifest_header(
        teacher.layer_ids, teacher.hidden_size, cfg.teacher.dtype, cfg.teacher.top_k, cfg.storage.hidden_format,
        teacher=teacher.identity, tokenizer=tokenizer_hashes(teacher.tokenizer),
        corpus={"fingerprint": corpus_fingerprint(files), "files": len(files)},
        content_options=_content_options(cfg), build=cfg.to_dict(),
    )


def _resume_view(manifest: dict, key: str):
    value = manifest.get(key)
    if key == "teacher" and isinstance(value, dict):  # the hashes identify it; the path may move
        value = {k: v for k, v in value.items() if k not in ("name", "revision")}
    if key == "hidden_format":  # caches from before fp8 existed are lossless
        value = fmt.hidden_format_of(manifest)
    return value


def _mismatch(existing: dict, header: dict) -> str | None:
    return first_difference(existing, header, RESUME_KEYS, view=_resume_view, earlier_name="cache", now_name="this build")


def committed_records(fs, root: str, rank: int) -> list[dict]:
    """Commit records of this rank's shards, in order; the source of truth on resume."""
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if not fs.exists(shards_dir):
        return []
    prefix = fmt.shard_name(rank, 0)[:-6]
    records = []
    for path in sorted(fs.glob(fmt.join(shards_dir, f"{prefix}*.json"))):
        # a record's name becomes a path (resume, finalize): the same check as the reader's
        records.append(fmt.check_shard_paths(fmt.read_json(fs, path), root, f"{fmt.SHARDS_DIR}/{path.rsplit('/', 1)[-1]}"))
    records.sort(key=lambda r: r["index"])
    # The writer commits in order, so committed shards are a prefix 0..n-1.
    for expected, record in enumerate(records):
        if record["index"] != expected:
            raise CacheError(f"shard records of rank {rank} have a gap at index {expected}; run `dflash-cache verify` and rebuild with --overwrite")
    return records


def _remove_uncommitted(fs, root: str, rank: int, committed: set[str]) -> int:
    """Delete this rank's shard folders without a commit record (a crash mid-write left them);
    other ranks' folders are theirs to clean."""
    shards_dir = fmt.join(root, fmt.SHARDS_DIR)
    if not fs.exists(shards_dir):
        return 0
    prefix = fmt.shard_name(rank, 0)[:-6]
    removed = 0
    for path in fs.ls(shards_dir, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name.endswith(".json") or name in committed:
            continue
        if name.startswith(prefix) or name.startswith(f".tmp-{prefix}"):
            fs.rm(path, recursive=True)
            removed += 1
    return removed


def _is_manifest_leftover(path: str) -> bool:
    """A temporary manifest left by a build killed before its first rename (local storage)."""
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(f"{fmt.MANIFEST}.tmp-")


def _is_lock(path: str) -> bool:
    """A rank's lock file (_lock_name): a build takes it before it writes its manifest."""
    return bool(_LOCK.match(path.rstrip("/").rsplit("/", 1)[-1]))


# One writer per rank of a cache: each rank writes only its own shards (shard-rRRRRR-*), so two
# ranks of one torchrun build share the folder, and two builds of the same rank are refused.
_LOCK = re.compile(r"^\.dflash-r\d{5}\.lock$")


def _lock_name(rank: int) -> str:
    return f".dflash-r{rank:05d}.lock"


@contextmanager
def _writing(what: str, url: str):
    """A full disk or a failing store is an expected failure: one line, and the rerun resumes."""
    try:
        yield
    except OSError as err:
        raise CacheError(f"writing {what} to {url} failed: {err}; free space or fix the storage, then rerun the same command to resume") from err


# Names a build writes under shards/: shard folders, their commit records and temporaries.
_SHARD_ENTRY = re.compile(r"^\.?(tmp-)?shard-r\d{5}-\d{6}(\.json)?(-[0-9a-f]{8})?(\.tmp-[0-9a-f]+)?$")


def _delete_cache(fs, root: str, url: str) -> None:
    """--overwrite on a dflash cache: delete what a build wrote (manifest, shards/, teacher/,
    ranks/); anything else in those folders stops it before a file is deleted."""
    doomed = []
    for sub, ours in ((fmt.SHARDS_DIR, lambda name, kind: bool(_SHARD_ENTRY.match(name))),
                      (fmt.TEACHER_DIR, lambda name, kind: kind == "file"),
                      (RANKS_DIR, lambda name, kind: kind == "file" and name.startswith("rank-"))):
        folder = fmt.join(root, sub)
        if not fs.exists(folder):
            continue
        for entry in fs.ls(folder, detail=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if not ours(name, entry.get("type")):
                raise CacheError(f"{url}: {sub}/{name} is not a file dflash writes; --overwrite deletes only what a build "
                                 "made, so nothing was deleted: move it out of the cache and rerun")
        doomed.append(folder)
    for folder in doomed:
        fs.rm(folder, recursive=True)
    fs.rm(fmt.join(root, fmt.MANIFEST))


def _existing_manifest(fs, root: str, url: str) -> dict | None:
    """The manifest of the cache at --out (None: a new or empty folder); refuses a file, a
    non-empty folder without one, and another tool's manifest. Read-only: checked before the
    build's lock file is made, so a folder that is not ours is never written into."""
    manifest_path = fmt.join(root, fmt.MANIFEST)
    if fs.isfile(root):
        raise CacheError(f"--out {url} is a file, not a folder; choose a new or empty folder for the cache")
    if not fs.exists(manifest_path) and fs.exists(root):
        others = [p for p in fs.ls(root, detail=False) if not _is_manifest_leftover(p) and not _is_lock(p)]
        # checked again after the listing: another rank of this build writes the manifest first,
        # and may have done so since the first check (then the listing shows it, or its shards)
        if others and not fs.exists(manifest_path):
            raise CacheError(f"{url} is a non-empty folder without a dflash manifest; choose an empty or new --out")
    if not fs.exists(manifest_path):
        return None
    try:
        existing = fmt.read_json(fs, manifest_path)
    except ValueError:
        existing = None
    if not isinstance(existing, dict) or existing.get("format") != fmt.FORMAT_NAME:
        raise CacheError(f"{url} holds a manifest.json that is not a dflash cache's; choose another --out "
                         "(--overwrite deletes only dflash caches)")
    return existing


def _prepare_output(fs, root: str, url: str, header: dict, overwrite: bool) -> None:
    existing = _existing_manifest(fs, root, url)
    if existing is not None:
        problem = _mismatch(existing, header) if existing.get("format_version") == fmt.FORMAT_VERSION else "format version differs"
        if problem and not overwrite:
            raise CacheError(f"{url} holds a cache built with other settings: {problem}; rerun with the original settings to resume, or pass --overwrite to replace it")
        if overwrite:
            _delete_cache(fs, root, url)
    if fmt.is_local(fs):
        # only the root: the manifest is the first thing a build writes, so a build killed before
        # it leaves at most a temporary manifest, which the rerun accepts (see _is_manifest_leftover)
        fs.makedirs(root, exist_ok=True)
    elif not fs.exists(root.split("/", 1)[0]):  # makedirs would silently create a mistyped bucket
        raise CacheError(f"{url}: the bucket {root.split('/', 1)[0]!r} does not exist; create it or fix --out")


# A single-process build's live manifest is rewritten after every commit while it lists fewer
# shards than this (under ~1 MB of JSON); past it, see manifest_due.
LIVE_MANIFEST_SHARDS = 1000


def manifest_due(shards: int, since_last_s: float, last_write_s: float) -> bool:
    """Whether a single-process build rewrites its live manifest after a commit: always while it
    is small, then only once the time since the last rewrite is 100x what that rewrite took, so
    rewrites stay under ~1% of the build. Rewriting per shard would be quadratic: a production
    build of ~100k shards has a ~100 MB manifest. Resume reads the commit records, not this."""
    return shards < LIVE_MANIFEST_SHARDS or since_last_s >= 100 * last_write_s


class _ManifestKeeper:
    """Keeps manifest.json up to date: rewritten (atomically) after committed shards when one
    process builds (each one while the manifest is small, see manifest_due); with several ranks
    only the finalize step writes it, from all commit records."""

    def __init__(self, fs, root: str, header: dict, records: list[dict], live: bool):
        self.fs, self.root, self.header, self.live = fs, root, header, live
        self.records = list(records)
        self.bytes = sum(int(r["bytes"]) for r in self.records)  # kept up to date: read per progress update
        self.lock = threading.Lock()
        self.last_written, self.last_write_s = time.perf_counter(), 0.0
        if live or not fs.exists(fmt.join(root, fmt.MANIFEST)):
            self.write(complete=False)

    def commit(self, record: dict) -> None:
        with self.lock:
            self.records.append(record)
            self.bytes += int(record["bytes"])
            if self.live and manifest_due(len(self.records), time.perf_counter() - self.last_written, self.last_write_s):
                self.write(complete=False)

    def write(self, complete: bool, fault: bool = True, **extra) -> dict:
        """`fault`: whether this write counts as a `during_manifest_write` fault point (the crash
        tests count the writes that follow commits; the one recording the head is not one)."""
        started = time.perf_counter()
        manifest = fmt.write_manifest(self.fs, self.root, self.header, self.records, complete,
                                      fault_point="during_manifest_write" if fault else None, **extra)
        self.last_written = time.perf_counter()
        self.last_write_s = self.last_written - started
        return manifest


RANKS_DIR = "ranks"


def _rank_marker(root: str, rank: int) -> str:
    return fmt.join(root, RANKS_DIR, f"rank-{rank:05d}.json")


def finalize_cache(url: str, storage_options: dict | None = None) -> dict:
    """Merge every rank's commit records into a complete manifest once all ranks are done.

    The last rank of a multi-process build calls this itself; `dflash-cache finalize` calls it
    for ranks launched as independent jobs. Refuses while a rank is unfinished or when two ranks
    wrote the same sequence id.
    """
    fs, root = fmt.url_to_fs(url, storage_options)
    manifest = fmt.read_manifest(fs, root, url)
    world = int(manifest["content_options"]["world_size"])
    missing = [r for r in range(world) if not fs.exists(_rank_marker(root, r))]
    if missing:
        raise CacheError(f"{url}: rank(s) {missing} of {world} have not finished; rerun their build (same command with RANK set) before finalizing")
    records = [r for rank in range(world) for r in committed_records(fs, root, rank)]
    seen: dict[str, str] = {}
    for record in records:
        for seq_id in _committed_ids(fs, root, [record]):
            if seq_id in seen:
                raise CacheError(f"{url}: sequence id {seq_id!r} is in both {seen[seq_id]} and {record['name']}; make corpus ids unique and rebuild")
            seen[seq_id] = record["name"]
    runs = [fmt.read_json(fs, _rank_marker(root, r)) for r in range(world)]
    last_run = {"seconds": max(r["seconds"] for r in runs), "tokens": sum(r["tokens"] for r in runs),
                "padding_fraction": max(r["padding_fraction"] for r in runs)}
    header = {k: v for k, v in manifest.items() if k not in ("shards", "totals", "complete", "last_run")}
    # rank 0 wrote the teacher head and put its record in its marker (the first manifest may be
    # another rank's, written before the head existed)
    head = runs[0].get("teacher_head")
    if head:
        header["teacher_head"] = head
    keeper = _ManifestKeeper(fs, root, header, records, live=False)
    return keeper.write(complete=True, last_run=last_run)


def _committed_ids(fs, root: str, records: list[dict]) -> dict[str, int]:
    import pyarrow as pa

    seen: dict[str, int] = {}
    for record in records:
        path = fmt.join(root, fmt.SHARDS_DIR, record["name"], fmt.SEQUENCES)
        table = pa.ipc.open_file(pa.BufferReader(fs.cat_file(path))).read_all()
        for seq_id, row in zip(table.column("id").to_pylist(), table.column("row").to_pylist()):
            seen[seq_id] = row
    return seen


def run_teacher(teacher: Teacher, sequences: list, rows: list[int], rank: int, index: int,
                row_span: tuple[int, int], skipped: dict[str, int], stats: dict) -> ShardData:
    """Run the teacher over one shard's sequences (bucketed batches) and pack the results."""
    lengths = np.array([len(s.input_ids) for s in sequences], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    n_tokens, n_layers, k = int(offsets[-1]), len(teacher.layer_ids), teacher.cfg.top_k
    hidden = np.empty((n_tokens, n_layers, teacher.hidden_size), dtype=fmt.HIDDEN_STORAGE[teacher.cfg.dtype])
    topk_ids = np.empty((n_tokens, k), dtype=np.int32)
    topk_logprobs = np.empty((n_tokens, k), dtype=np.float32)
    finite = np.ones(len(sequences), dtype=bool)
    batches = teacher.batches(lengths) if len(sequences) else []
    for batch in batches:
        out = teacher.forward([sequences[i].input_ids for i in batch])
        pos = 0
        for i in batch:
            lo, hi, n = offsets[i], offsets[i + 1], lengths[i]
            hidden[lo:hi] = out.hidden[pos:pos + n]
            topk_ids[lo:hi] = out.topk_ids[pos:pos + n]
            topk_logprobs[lo:hi] = out.topk_logprobs[pos:pos + n]
            pos += n
        finite[batch] = out.finite
        stats["tokens"] += int(lengths[batch].sum())
        stats["padded"] += int(lengths[batch].max()) * len(batch) if teacher.pads_batches else int(lengths[batch].sum())
        stats["progress"].advance(len(batch), **stats["show"]())
    shard = ShardData(
        rank=rank, index=index, row_start=row_span[0], row_end=row_span[1],
        ids=[s.id for s in sequences], rows=np.array(rows, dtype=np.int64), lengths=lengths,
        truncated=np.array([s.truncated for s in sequences], dtype=bool),
        input_ids=np.concatenate([s.input_ids for s in sequences]) if sequences else np.zeros(0, np.int32),
        loss_mask=np.concatenate([s.loss_mask for s in sequences]) if sequences else np.zeros(0, np.uint8),
        hidden=hidden, topk_ids=topk_ids, topk_logprobs=topk_logprobs, skipped=dict(skipped),
    )
    if not finite.all():
        shard = shard.drop(finite)
        shard.skipped["nonfinite"] = shard.skipped.get("nonfinite", 0) + int((~finite).sum())
        stats["progress"].message(f"teacher outputs were NaN/Inf for {int((~finite).sum())} sequence(s) in shard {shard.name}; not written (ids: {[s.id for s, f in zip(sequences, finite) if not f][:5]})")
    return shard


def build_cache(cfg: BuildConfig, progress: Progress | None = None) -> dict:
    """Build (or resume) the cache; returns the final manifest."""
    progress = progress or Progress()
    files = list_corpus_files(cfg.corpus.data)
    total_rows = require_rows(files, cfg.corpus.data)
    fs, root = fmt.url_to_fs(cfg.out, cfg.storage_options)
    # the layer choice is refused from the config alone, before a large teacher is loaded
    resolve_layers(cfg.teacher, int(load_config(cfg.teacher).num_hidden_layers), exact_count=True)
    if cfg.engine == "vllm":
        find_vllm_python(cfg.vllm_python)  # refused before the lock file and the teacher
    with ExitStack() as held:
        if fmt.is_local(fs):
            # one build per rank of a folder, for the whole build (before the teacher is loaded, so
            # a second build stops at once); object stores have no lock: one writer is the user's job
            _existing_manifest(fs, root, cfg.out)  # never make a lock file in a folder that is not ours
            held.enter_context(one_writer(root, "dflash-cache build" + (f" of rank {cfg.rank}" if cfg.world_size > 1 else ""),
                                          "wait for it to end (or stop it), or choose another --out", _lock_name(cfg.rank)))
        return _build_locked(cfg, progress, files, total_rows, fs, root)


def load_build_teacher(cfg: BuildConfig) -> Teacher:
    """The teacher of a build, run by its engine; close() it when done."""
    if cfg.engine == "vllm":
        from dflash_cache.vllm_engine import load_vllm_teacher

        return load_vllm_teacher(cfg.teacher, cfg.vllm, cfg.corpus.max_length, cfg.vllm_python)
    return load_teacher(cfg.teacher)


def _build_locked(cfg: BuildConfig, progress: Progress, files: list[str], total_rows: int, fs, root: str) -> dict:
    teacher = load_build_teacher(cfg)
    try:
        return _build_with(cfg, progress, files, total_rows, fs, root, teacher)
    finally:
        teacher.close()


def _build_with(cfg: BuildConfig, progress: Progress, files: list[str], total_rows: int, fs, root: str,
                teacher: Teacher) -> dict:
    header = _header(cfg, teacher, files)
    with fmt.reaching(cfg.out):
        _prepare_output(fs, root, cfg.out, header, cfg.overwrite)

    records = committed_records(fs, root, cfg.rank)
    manifest_path = fmt.join(root, fmt.MANIFEST)
    previous = fmt.read_json(fs, manifest_path) if fs.exists(manifest_path) else {}
    previous_run = previous.get("last_run")
    marker = _rank_marker(root, cfg.rank)
    # the head's record, kept from the manifest (one process) or this rank's marker (several)
    # when the head is not written again below
    head_record = previous.get("teacher_head") or (fmt.read_json(fs, marker).get("teacher_head")
                                                   if fs.exists(marker) else None)
    with _writing("the manifest", cfg.out):  # first: it marks the folder as a cache under construction
        keeper = _ManifestKeeper(fs, root, header, records, live=cfg.world_size == 1)
    if cfg.world_size == 1:  # other ranks may be writing a manifest of their own right now
        for path in fs.ls(root, detail=False):
            if _is_manifest_leftover(path):
                fs.rm(path)
    removed = _remove_uncommitted(fs, root, cfg.rank, {r["name"] for r in records})
    # rewritten when missing, and when its record is lost before this rank committed anything (a
    # build killed between writing the head and recording it): then a rewrite costs little
    if cfg.rank == 0 and (not fs.exists(fmt.join(root, fmt.TEACHER_DIR, fmt.TEACHER_HEAD))
                          or (not records and not head_record)):
        with _writing("the teacher files", cfg.out):
            head_record = write_teacher_files(fs, root, teacher.model, teacher.tokenizer)
    if cfg.rank == 0 and head_record:
        keeper.header["teacher_head"] = head_record
        if keeper.live:  # recorded at once, not with the first commit
            with _writing("the manifest", cfg.out):
                keeper.write(complete=False, fault=False)
    if fs.exists(_rank_marker(root, cfg.rank)):  # this rank is at work again, not finished
        fs.rm(_rank_marker(root, cfg.rank))
    start_row = records[-1]["rows"][1] if records else 0
    if records:
        progress.message(f"resuming: {len(records)} committed shard(s) kept, continuing at corpus row {start_row}"
                         + (f", {removed} uncommitted shard(s) removed" if removed else ""))

    per_token_hidden = fmt.hidden_bytes_per_token(len(teacher.layer_ids), teacher.hidden_size, cfg.teacher.dtype,
                                                  cfg.storage.hidden_format)
    shard_tokens = max(1, cfg.storage.shard_bytes // per_token_hidden)
    seen = _committed_ids(fs, root, records)
    started = time.perf_counter()
    stats = {"tokens": 0, "padded": 0, "progress": progress}
    stats["show"] = lambda: {
        "tok/s": f"{stats['tokens'] / max(time.perf_counter() - started, 1e-9):,.0f}",
        "written": f"{keeper.bytes / 1e6:,.1f}MB",
    }
    writer = BackgroundWriter(lambda shard: write_shard(fs, root, shard, cfg.storage, cfg.teacher.dtype), keeper.commit)
    progress.start(max(total_rows - start_row, 0) // cfg.world_size, "sequences", "seq")

    pending, pending_rows, pending_tokens, skipped = [], [], 0, Counter()
    span_start, index = start_row, len(records)

    def flush(row_end: int):
        nonlocal pending, pending_rows, pending_tokens, skipped, span_start, index
        shard = run_teacher(teacher, pending, pending_rows, cfg.rank, index, (span_start, row_end), skipped, stats)
        writer.submit(shard)
        pending, pending_rows, pending_tokens, skipped = [], [], 0, Counter()
        span_start, index = row_end, index + 1

    next_row = start_row
    try:
        for row in iter_rows(cfg.corpus, start_row=start_row):
            next_row = row.index + 1
            if row.index % cfg.world_size != cfg.rank:
                continue
            result = _sequence_or_skip(row, teacher.tokenizer, cfg.corpus, seen)
            if isinstance(result, str):
                skipped[result] += 1
                progress.advance(1)
            else:
                pending.append(result)
                pending_rows.append(row.index)
                pending_tokens += len(result.input_ids)
            if pending_tokens >= shard_tokens:
                flush(next_row)
        if pending or skipped:
            flush(next_row)
    except BaseException:
        try:  # shards already queued are valid work: let them commit, but report the first error
            writer.close()
        except Exception:
            pass
        raise
    else:
        writer.close()
    finally:
        progress.close()

    last_run = {
        "seconds": round(time.perf_counter() - started, 3),
        "tokens": stats["tokens"],
        "padding_fraction": round(1 - stats["tokens"] / stats["padded"], 4) if stats["padded"] else 0.0,
    }
    if not stats["padded"] and previous_run:  # a rerun of a finished build ran no teacher: keep what the last one did
        last_run = previous_run
    if cfg.world_size == 1:
        with _writing("the manifest", cfg.out):
            manifest = keeper.write(complete=True, last_run=last_run)
    else:
        # Each rank marks itself done; whichever rank sees all markers merges the manifest (the
        # last to finish always does, and a duplicate merge writes the same bytes).
        fs.makedirs(fmt.join(root, RANKS_DIR), exist_ok=True)
        head = {"teacher_head": head_record} if cfg.rank == 0 and head_record else {}
        fmt.write_json_atomic(fs, _rank_marker(root, cfg.rank), {"rank": cfg.rank, **last_run, **head})
        try:
            manifest = finalize_cache(cfg.out, cfg.storage_options)
        except CacheError as err:
            if "have not finished" not in str(err):
                raise
            progress.message(f"rank {cfg.rank} done ({len(keeper.records)} shard(s)); the last rank to finish completes the manifest")
            return fmt.read_manifest(fs, root, cfg.out)
    t = manifest["totals"]
    progress.message(
        f"committed {t['shards']} shard(s): {t['sequences']:,} sequences, {t['tokens']:,} tokens, "
        f"{t['bytes'] / 1e6:,.1f} MB; padding {manifest['last_run']['padding_fraction']:.1%}"
        + (f"; skipped {t['skipped']}" if t["skipped"] else "")
    )
    return manifest
