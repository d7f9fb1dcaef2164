"""Stage 1: corpus -> tokens -> teacher forward -> committed shards -> manifest.

The corpus is cut into shards by a deterministic rule (consecutive rows until the shard's token
budget is reached), so a build that is interrupted anywhere and rerun produces exactly the cache
an uninterrupted build would: committed shards are kept, everything else is redone.

This module is the loop (rows -> sequences -> the shard writer, which cuts shards and has the
teacher run on each) and the teacher's pass over a shard; ``dflash_cache.writer`` writes and
commits shards, ``dflash_cache.commit`` prepares the output folder, resumes and keeps the manifest.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from dflash_cache import format as fmt
from dflash_cache.commit import (
    ManifestKeeper,
    Resume,
    complete_rank,
    existing_manifest,
    lock_name,
    open_output,
    prepare_output,
)
from dflash_cache.corpus import (
    CorpusConfig,
    corpus_fingerprint,
    iter_rows,
    list_corpus_files,
    require_rows,
    tokenize_row,
)
from dflash_cache.cross_check import CrossCheck
from dflash_cache.settings.build_config import BuildConfig
from dflash_cache.writer import PendingShard, ShardData, ShardWriter, shard_tokens, write_teacher_files
from dflash_common.errors import BadRowError
from dflash_common.files import one_writer
from dflash_common.progress import Progress
from dflash_common.vllm_env import find_vllm_python
from dflash_teacher.tapped_layers import resolve_layers
from dflash_teacher.teacher import (
    Teacher,
    identity_like,
    load_config,
    load_teacher,
    load_tokenizer,
    tokenizer_hashes,
)


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
    for row in iter_rows(cfg.corpus, files=files):
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
    per_shard = shard_tokens(cfg.storage.shard_bytes, per_token_hidden)
    return DryRunEstimate(
        rows=rows, sequences=sequences, tokens=tokens, loss_tokens=loss_tokens, skipped=dict(skipped),
        bytes_per_token=per_token, bytes=tokens * per_token, shards=max(1, math.ceil(tokens / per_shard)),
    )


def _header(cfg: BuildConfig, teacher: Teacher, files: list[str], recorded_teacher: dict | None = None) -> dict:
    """The manifest header of this build; `recorded_teacher` (the cache's, on resume) decides how
    the teacher's weights are hashed (identity_like: caches from before the file hash)."""
    return fmt.manifest_header(
        teacher.layer_ids, teacher.hidden_size, cfg.teacher.dtype, cfg.teacher.top_k, cfg.storage.hidden_format,
        teacher=identity_like(teacher, recorded_teacher), tokenizer=tokenizer_hashes(teacher.tokenizer),
        corpus={"fingerprint": corpus_fingerprint(files), "files": len(files)},
        content_options=_content_options(cfg), build=cfg.to_dict(),
    )


@dataclass
class BuildStats:
    """What this run of a build computed (the cache's totals come from its commit records)."""

    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    """Sequence tokens the teacher ran on."""
    padded: int = 0
    """Tokens it computed, padding included (`tokens` for an engine that does not pad)."""

    def add_batch(self, lengths: np.ndarray, padded: bool) -> None:
        self.tokens += int(lengths.sum())
        self.padded += int(lengths.max()) * len(lengths) if padded else int(lengths.sum())

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def last_run(self) -> dict:
        """The manifest's `last_run`."""
        return {
            "seconds": round(time.perf_counter() - self.started, 3),
            "tokens": self.tokens,
            "padding_fraction": round(1 - self.tokens / self.padded, 4) if self.padded else 0.0,
        }


def _teacher_outputs(teacher: Teacher, sequences: list, lengths: np.ndarray, on_batch):
    """Submit the teacher's forwards of one shard; the function returned waits for them and gives
    the hidden states, top-k ids and log-probs of every token (packed back to back in sequence
    order) and whether each sequence's outputs are finite; ``on_batch(lengths)`` after each batch."""
    batches = teacher.batches(lengths) if len(sequences) else []
    results = [teacher.submit([sequences[i].input_ids for i in batch]) for batch in batches]

    def collect():
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        n_tokens, n_layers, k = int(offsets[-1]), len(teacher.layer_ids), teacher.cfg.top_k
        hidden = np.empty((n_tokens, n_layers, teacher.hidden_size), dtype=fmt.HIDDEN_STORAGE[teacher.cfg.dtype])
        topk_ids = np.empty((n_tokens, k), dtype=np.int32)
        topk_logprobs = np.empty((n_tokens, k), dtype=np.float32)
        finite = np.ones(len(sequences), dtype=bool)
        for batch, result in zip(batches, results):
            out = result()
            pos = 0
            for i in batch:
                lo, hi, n = offsets[i], offsets[i + 1], lengths[i]
                hidden[lo:hi] = out.hidden[pos:pos + n]
                topk_ids[lo:hi] = out.topk_ids[pos:pos + n]
                topk_logprobs[lo:hi] = out.topk_logprobs[pos:pos + n]
                pos += n
            finite[batch] = out.finite
            on_batch(lengths[batch])
        return hidden, topk_ids, topk_logprobs, finite

    return collect


class TeacherPass:
    """Runs the teacher over one cut shard's sequences (bucketed batches) and packs the results;
    counts what it computed in ``stats`` and shows each batch on ``progress``. ``start(pending)``
    submits the shard's forwards and returns the function that waits for them and makes the
    ShardData (ShardWriter keeps ``in_flight`` shards started at once)."""

    def __init__(self, teacher: Teacher, stats: BuildStats, progress: Progress, keeper: ManifestKeeper,
                 cross_check: CrossCheck | None = None):
        self.teacher, self.stats, self.progress, self.keeper = teacher, stats, progress, keeper
        self.cross_check = cross_check
        self.in_flight = teacher.shards_in_flight

    def _batch_done(self, lengths: np.ndarray) -> None:
        self.stats.add_batch(lengths, self.teacher.pads_batches)
        self.progress.advance(len(lengths), **{"tok/s": f"{self.stats.tokens_per_s():,.0f}",
                                               "written": f"{self.keeper.bytes / 1e6:,.1f}MB"})

    def start(self, pending: PendingShard):
        lengths = np.array([len(s.input_ids) for s in pending.sequences], dtype=np.int32)
        outputs = _teacher_outputs(self.teacher, pending.sequences, lengths, self._batch_done)
        return lambda: self._finish(pending, lengths, *outputs())

    def _finish(self, pending: PendingShard, lengths: np.ndarray, hidden, topk_ids, topk_logprobs, finite) -> ShardData:
        sequences = pending.sequences
        shard = ShardData(
            rank=pending.rank, index=pending.index, row_start=pending.row_start, row_end=pending.row_end,
            ids=[s.id for s in sequences], rows=np.array(pending.rows, dtype=np.int64), lengths=lengths,
            truncated=np.array([s.truncated for s in sequences], dtype=bool),
            input_ids=np.concatenate([s.input_ids for s in sequences]) if sequences else np.zeros(0, np.int32),
            loss_mask=np.concatenate([s.loss_mask for s in sequences]) if sequences else np.zeros(0, np.uint8),
            hidden=hidden, topk_ids=topk_ids, topk_logprobs=topk_logprobs, skipped=dict(pending.skipped),
        )
        if not finite.all():
            shard = shard.drop(finite)
            shard.skipped["nonfinite"] = shard.skipped.get("nonfinite", 0) + int((~finite).sum())
            self.progress.message(f"teacher outputs were NaN/Inf for {int((~finite).sum())} sequence(s) in shard {shard.name}; not written (ids: {[s.id for s, f in zip(sequences, finite) if not f][:5]})")
        if self.cross_check is not None:
            self.cross_check.check_shard(pending.index, shard)
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
            existing_manifest(fs, root, cfg.out)  # never make a lock file in a folder that is not ours
            held.enter_context(one_writer(root, "dflash-cache build" + (f" of rank {cfg.rank}" if cfg.world_size > 1 else ""),
                                          "wait for it to end (or stop it), or choose another --out", lock_name(cfg.rank)))
        teacher = load_build_teacher(cfg)
        for note in getattr(teacher, "notes", ()):
            progress.message(note)
        try:
            return _build_with(cfg, progress, files, total_rows, fs, root, teacher)
        finally:
            teacher.close()


def load_build_teacher(cfg: BuildConfig) -> Teacher:
    """The teacher of a build, run by its engine; close() it when done."""
    if cfg.engine == "vllm":
        from dflash_teacher.vllm_engine import load_vllm_teacher

        return load_vllm_teacher(cfg.teacher, cfg.vllm, cfg.corpus.max_length, cfg.vllm_python)
    return load_teacher(cfg.teacher)


def _build_with(cfg: BuildConfig, progress: Progress, files: list[str], total_rows: int, fs, root: str,
                teacher: Teacher) -> dict:
    with fmt.reaching(cfg.out):
        existing = None if cfg.overwrite else existing_manifest(fs, root, cfg.out)
    header = _header(cfg, teacher, files, (existing or {}).get("teacher"))
    with fmt.reaching(cfg.out):
        version = prepare_output(fs, root, cfg.out, header, cfg.overwrite, cfg.storage.format_version)
    resume = open_output(fs, root, cfg.out, header, cfg.rank, live=cfg.world_size == 1,
                         write_head=lambda: write_teacher_files(fs, root, teacher.model, teacher.tokenizer))
    if resume.records:
        progress.message(f"resuming: {len(resume.records)} committed shard(s) kept, continuing at corpus row {resume.start_row}"
                         + (f", {resume.removed} uncommitted shard(s) removed" if resume.removed else ""))
    stats = BuildStats()
    with ExitStack() as held:
        cross_check = _cross_check(cfg, teacher, held)
        _write_corpus(cfg, files, teacher, resume, stats, progress, fs, root, total_rows, version, cross_check)
    last_run = stats.last_run()
    if cross_check is not None and cross_check.checked:
        last_run["cross_check"] = cross_check.record()
        progress.message(f"cross-check: {cross_check.checked} sequence(s) recomputed by the transformers engine; largest "
                         f"relative difference {max(cross_check.hidden):.3g} (hidden states), "
                         f"{cross_check.logprobs:.3g} (log-probs)")
    if not stats.padded and resume.previous_run:  # a rerun of a finished build ran no teacher: keep what the last one did
        last_run = resume.previous_run
    manifest = complete_rank(fs, root, cfg.out, cfg.storage_options, resume, cfg.rank, last_run)
    if manifest is None:
        progress.message(f"rank {cfg.rank} finished its part ({len(resume.keeper.records)} shard(s)); the last rank to "
                         "finish completes the cache")
        return fmt.read_manifest(fs, root, cfg.out)
    t = manifest["totals"]
    progress.message(
        f"committed {t['shards']} shard(s): {t['sequences']:,} sequences, {t['tokens']:,} tokens, "
        f"{t['bytes'] / 1e6:,.1f} MB; padding {manifest['last_run']['padding_fraction']:.1%}"
        + (f"; skipped {t['skipped']}" if t["skipped"] else "")
    )
    return manifest


def _cross_check(cfg: BuildConfig, teacher: Teacher, held: ExitStack) -> CrossCheck | None:
    """The build's cross-check (None when off); its reference teacher is the build's own when that
    is the transformers engine, else loaded on first use and closed with `held`."""
    if not cfg.cross_check:
        return None
    loaded: list[Teacher] = []

    def reference() -> Teacher:
        if teacher.holds_whole_model:
            return teacher
        if not loaded:
            loaded.append(load_teacher(cfg.teacher, teacher.tokenizer))
            held.callback(loaded[0].close)
        return loaded[0]

    return CrossCheck(cfg.cross_check, cfg.cross_check_bound, reference, list(teacher.layer_ids), cfg.rank)


def _write_corpus(cfg: BuildConfig, files: list[str], teacher: Teacher, resume: Resume, stats: BuildStats,
                  progress: Progress, fs, root: str, total_rows: int, version: int = fmt.FORMAT_VERSION,
                  cross_check: CrossCheck | None = None) -> None:
    """Rows -> sequences -> the shard writer, from the resume point to the corpus's end; returns
    once every shard is committed."""
    seen = resume.seen(fs, root)
    per_token_hidden = fmt.hidden_bytes_per_token(len(teacher.layer_ids), teacher.hidden_size, cfg.teacher.dtype,
                                                  cfg.storage.hidden_format)
    writer = ShardWriter(fs, root, cfg.storage, cfg.teacher.dtype, per_token_hidden,
                         TeacherPass(teacher, stats, progress, resume.keeper, cross_check), resume.keeper.commit,
                         cfg.rank, len(resume.records), resume.start_row, version, list(teacher.layer_ids))
    progress.start(max(total_rows - resume.start_row, 0) // cfg.world_size, "sequences", "seq")
    end_row = resume.start_row
    try:
        for row in iter_rows(cfg.corpus, start_row=resume.start_row, files=files):
            end_row = row.index + 1
            if row.index % cfg.world_size != cfg.rank:
                continue
            result = _sequence_or_skip(row, teacher.tokenizer, cfg.corpus, seen)
            if isinstance(result, str):
                writer.skip(result)
                progress.advance(1)
            else:
                writer.write(row.index, result)
    except BaseException:
        writer.abort()  # shards already submitted are valid work: let them commit, but report this error
        raise
    else:
        writer.close(end_row)
    finally:
        progress.close()
