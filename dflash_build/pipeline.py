"""Stage 1: corpus -> tokens -> the shard cut -> teacher forward -> written, committed shards -> manifest.

The corpus is cut into shards by a deterministic rule (consecutive rows until the shard's token
budget is reached), so a build that is interrupted anywhere and rerun produces exactly the cache
an uninterrupted build would: committed shards are kept, everything else is redone.

This module is the build from end to end: the output folder prepared and resumed into, then the
loop (``_write_corpus``: rows -> sequences -> ``shard_cut`` -> ``shard_queue``, which runs the
teacher on each cut shard (``teacher_pass``) and hands its data to the writer thread, which writes
it (``dflash_cache.writer``) and tells the manifest keeper (``commit``)), then the rank completed
(``resume``); ``estimate`` sizes a build without the teacher.
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

from dflash_build.cross_check import CrossCheck
from dflash_build.output import existing_manifest, lock_name, prepare_output
from dflash_build.resume import Resume, complete_rank, open_output
from dflash_build.settings.build_config import BuildConfig
from dflash_build.shard_cut import ShardCut, group_start, shard_tokens, shards_per_generate
from dflash_build.shard_queue import ShardQueue, write_committed
from dflash_build.teacher_pass import BuildStats, TeacherPass
from dflash_build.tokens import tokenize_row
from dflash_cache import format as fmt
from dflash_cache.format.store import CacheStore
from dflash_cache.writer import write_teacher_files
from dflash_common.errors import BadRowError, ConfigError
from dflash_common.files import one_writer
from dflash_common.progress import Progress
from dflash_common.vllm_env import find_vllm_python
from dflash_corpus import (
    CorpusConfig,
    corpus_fingerprint,
    iter_rows,
    list_corpus_files,
    require_rows,
)
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


def _content_options(cfg: BuildConfig, group: int) -> dict:
    c = cfg.corpus
    options = {"max_length": c.max_length, "overlong": c.overlong, "min_length": c.min_length,
               "shard_bytes": cfg.storage.shard_bytes, "world_size": cfg.world_size}
    if c.chat_template_kwargs:  # absent for caches built before it existed and for none given
        options["chat_template_kwargs"] = c.chat_template_kwargs
    if group > 1:  # absent for one shard per generate, as in caches built before groups existed
        options["shards_per_generate"] = group
    return options


def generate_group(cfg: BuildConfig, taps: int, hidden_size: int) -> int:
    """Shards per engine generate of this build (a teacher of ``taps`` tapped layers of
    ``hidden_size``): vLLM's from --vllm-args generate_tokens, one for the transformers engine (it
    plans its own batches per shard)."""
    if cfg.engine != "vllm":
        return 1
    return shards_per_generate(cfg.vllm.generate_tokens, build_shard_tokens(cfg, taps, hidden_size))


def build_shard_tokens(cfg: BuildConfig, taps: int, hidden_size: int) -> int:
    """Tokens a shard of this build holds (a teacher of ``taps`` tapped layers of ``hidden_size``)."""
    per_token = fmt.hidden_bytes_per_token(taps, hidden_size, cfg.teacher.dtype, cfg.storage.hidden_format)
    return shard_tokens(cfg.storage.shard_bytes, per_token)


def refuse_other_group(existing: dict | None, group: int, url: str) -> None:
    """A cache resumes only with the shards per generate it was built with (a vLLM sequence's
    states may depend on the sequences sharing its engine steps): one line naming the fix."""
    if existing is None:
        return
    recorded = int((existing.get("content_options") or {}).get("shards_per_generate", 1))
    if recorded != group:
        given = ((existing.get("build") or {}).get("vllm") or {}).get("generate_tokens") if recorded > 1 else 1
        raise ConfigError(f"{url} was built with {recorded} shard(s) per vLLM generate, this build would send {group}; "
                          f"resume with --engine vllm --vllm-args '{{\"generate_tokens\": {given}}}' as it was built, "
                          "or rebuild with --overwrite")


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
        content_options=_content_options(cfg, generate_group(cfg, len(teacher.layer_ids), teacher.hidden_size)),
        build=cfg.to_dict(),
    )


def build_cache(cfg: BuildConfig, progress: Progress | None = None) -> dict:
    """Build (or resume) the cache; returns the final manifest."""
    progress = progress or Progress()
    files = list_corpus_files(cfg.corpus.data)
    total_rows = require_rows(files, cfg.corpus.data)
    store = CacheStore.open(cfg.out, cfg.storage_options)
    # the layer choice and a resume's other generate group are refused from the config alone,
    # before a large teacher (or vLLM's engine) is loaded
    config = load_config(cfg.teacher)
    layers = resolve_layers(cfg.teacher, int(config.num_hidden_layers), exact_count=True)
    if not cfg.overwrite:
        with fmt.reaching(cfg.out):
            existing = existing_manifest(store)
        if existing is not None:
            fmt.check_resumed_fields(existing, cfg.out)
        refuse_other_group(existing, generate_group(cfg, len(layers), int(config.hidden_size)), cfg.out)
    if cfg.engine == "vllm":
        find_vllm_python(cfg.vllm_python)  # refused before the lock file and the teacher
    with ExitStack() as held:
        if store.local:
            # one build per rank of a folder, for the whole build (before the teacher is loaded, so
            # a second build stops at once); object stores have no lock: one writer is the user's job
            existing_manifest(store)  # never make a lock file in a folder that is not ours
            held.enter_context(one_writer(store.root, "dflash-cache build" + (f" of rank {cfg.rank}" if cfg.world_size > 1 else ""),
                                          "wait for it to end (or stop it), or choose another --out", lock_name(cfg.rank)))
        teacher = load_build_teacher(cfg)
        for note in getattr(teacher, "notes", ()):
            progress.message(note)
        try:
            return _build_with(cfg, progress, files, total_rows, store, teacher)
        finally:
            teacher.close()


def load_build_teacher(cfg: BuildConfig) -> Teacher:
    """The teacher of a build, run by its engine; close() it when done."""
    if cfg.engine == "vllm":
        from dflash_teacher.vllm_engine import load_vllm_teacher

        return load_vllm_teacher(cfg.teacher, cfg.vllm, cfg.corpus.max_length, cfg.vllm_python,
                                 shard_tokens=lambda taps, hidden: build_shard_tokens(cfg, taps, hidden))
    return load_teacher(cfg.teacher)


def _build_with(cfg: BuildConfig, progress: Progress, files: list[str], total_rows: int, store: CacheStore,
                teacher: Teacher) -> dict:
    with fmt.reaching(cfg.out):
        existing = None if cfg.overwrite else existing_manifest(store)
    header = _header(cfg, teacher, files, (existing or {}).get("teacher"))
    with fmt.reaching(cfg.out):
        version = prepare_output(store, header, cfg.overwrite, cfg.storage.format_version)
    resume = open_output(store, header, cfg.rank, live=cfg.world_size == 1,
                         write_head=lambda: write_teacher_files(store, teacher.model, teacher.tokenizer))
    if resume.records:
        progress.message(f"resuming: {len(resume.records)} committed shard(s) kept, continuing at corpus row {resume.start_row}"
                         + (f", {resume.removed} uncommitted shard(s) removed" if resume.removed else ""))
    stats = BuildStats()
    with ExitStack() as held:
        cross_check = _cross_check(cfg, teacher, held)
        _write_corpus(cfg, files, teacher, resume, stats, progress, store, total_rows, version, cross_check)
    stats.seconds.update(getattr(teacher, "seconds", {}))  # the engine's parts (vLLM: engine, receive, head)
    last_run = stats.last_run()
    if cross_check is not None and cross_check.checked:
        last_run["cross_check"] = cross_check.record()
        progress.message(f"cross-check: {cross_check.checked} sequence(s) recomputed by the transformers engine; largest "
                         f"relative difference {max(cross_check.hidden):.3g} (hidden states), "
                         f"{cross_check.logprobs:.3g} (log-probs)")
    if not stats.padded and resume.previous_run:  # a rerun of a finished build ran no teacher: keep what the last one did
        last_run = resume.previous_run
    manifest = complete_rank(store, cfg.storage_options, resume, cfg.rank, last_run)
    if manifest is None:
        progress.message(f"rank {cfg.rank} finished its part ({len(resume.keeper.records)} shard(s)); the last rank to "
                         "finish completes the cache")
        return fmt.read_manifest(store)
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
                  progress: Progress, store: CacheStore, total_rows: int, version: int = fmt.FORMAT_VERSION,
                  cross_check: CrossCheck | None = None) -> None:
    """The build's loop, from the resume point to the corpus's end: rows -> sequences -> the cut
    (ShardCut) -> each cut shard to the teacher, then to the writer thread, which writes and commits
    it and tells the manifest keeper (ShardQueue). Returns once every shard is committed."""
    layer_ids = list(teacher.layer_ids)
    per_token_hidden = fmt.hidden_bytes_per_token(len(layer_ids), teacher.hidden_size, cfg.teacher.dtype,
                                                  cfg.storage.hidden_format)
    group = generate_group(cfg, len(teacher.layer_ids), teacher.hidden_size)
    first_index, start_row = group_start(resume.records, group, total_rows)
    if first_index < len(resume.records):
        progress.message(f"the generate group of shards from {first_index} on is computed again from corpus row {start_row}: "
                         f"its {len(resume.records) - first_index} committed shard(s) are sent as context, not rewritten")
    # the rows cut again as context are read again: their ids are not duplicates of themselves
    seen = {i: row for i, row in resume.seen(store).items() if row < start_row}
    cut = ShardCut(cfg.rank, first_index, start_row, shard_tokens(cfg.storage.shard_bytes, per_token_hidden),
                   committed=len(resume.records))
    shards = ShardQueue(TeacherPass(teacher, stats, progress, resume.keeper, cross_check),
                        partial(write_committed, store, cfg.storage, cfg.teacher.dtype, version, layer_ids, stats.seconds),
                        resume.keeper.commit, group, out=cfg.out, committed=len(resume.records))
    progress.start(max(total_rows - start_row, 0) // cfg.world_size, "sequences", "seq")
    end_row = start_row
    try:
        for row in iter_rows(cfg.corpus, start_row=start_row, files=files):
            end_row = row.index + 1
            if row.index % cfg.world_size != cfg.rank:
                continue
            result = _sequence_or_skip(row, teacher.tokenizer, cfg.corpus, seen)
            if isinstance(result, str):
                cut.skip(result)
                progress.advance(1)
            elif (pending := cut.add(row.index, result)) is not None:
                shards.put(pending)
    except BaseException:
        shards.abort()  # shards already submitted are valid work: let them commit, but report this error
        raise
    else:
        shards.close(cut.last(end_row))
    finally:
        progress.close()
